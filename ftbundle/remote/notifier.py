"""Telling someone a run has ended: a webhook's POST and a command, both at once, each tried
briefly within LIMIT_S in all, a failure said and never raised (ftbundle/notify.py: the job key
``notify:`` and the launcher's call; remote/watch.py: a detached run's rank 0 watcher). Shipped
as a part of the detached watcher's text (launch/stall.py WATCH_PARTS): standard library only,
no annotations the hosts' older Pythons cannot read. A URL is only ever shown as its scheme and
host (a token in its path or query is never printed)."""

import json
import os
import subprocess
import threading
import time
from urllib.parse import urlsplit

LIMIT_S = 10.0  # all tries of both notifiers, from the run's end
TRIES = 3
RETRY_PAUSE_S = 1.0


def shown(url):
    """The URL as it may be printed: scheme and host (and port); its user, path and query (where
    a webhook's secret lives: hooks.slack.com/services/T000/B000/XXXX) are left out."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "") + ("/..." if parts.path.strip("/")
                                                                                    or parts.query else "")


def post(url, payload, deadline):
    """POST ``payload`` until it is taken (2xx) or ``deadline``; None, or why not."""
    import urllib.error  # (here: urllib.request imports ssl and email, which no start needs)
    import urllib.request

    why = "not tried"
    for attempt in range(TRIES):
        left = deadline - time.monotonic()
        if left <= 0.05:
            return f"{why}; no time left for another try" if attempt else "no time left to try"
        request = urllib.request.Request(url, data=payload, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "ftbundle"})
        try:
            with urllib.request.urlopen(request, timeout=left) as answer:
                if 200 <= answer.status < 300:
                    return None
                why = f"HTTP {answer.status}"
        except urllib.error.HTTPError as exc:
            why = f"HTTP {exc.code}"
            if exc.code < 500 and exc.code != 429:  # (a client error: trying again will not help)
                return why
        except (TimeoutError, OSError) as exc:  # (urllib.error.URLError is an OSError)
            reason = getattr(exc, "reason", exc)
            why = ("no answer within the time left" if isinstance(reason, TimeoutError) or "timed out" in str(reason)
                   else str(reason))
        time.sleep(min(RETRY_PAUSE_S * (attempt + 1), max(0.0, deadline - time.monotonic())))
    return f"{why} ({TRIES} tries)"


def run_command(command, payload, summary, deadline, limit_s=LIMIT_S):
    env = {"FTB_RUN_ID": str(summary.get("run_id")), "FTB_STATE": str(summary.get("state")),
           "FTB_EXIT_CODE": str(summary.get("exit_code"))}
    try:
        done = subprocess.run(["sh", "-c", command], input=payload, capture_output=True,
                              timeout=max(0.1, deadline - time.monotonic()), env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return f"did not end within {limit_s:g}s (left running)"
    except OSError as exc:
        return str(exc)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"exit {done.returncode}" + (f": {said[0][:200]}" if said[0] else "")
    return None


def send(webhook, command, summary, say, limit_s=LIMIT_S):
    """Both notifiers at once (either may be None), within ``limit_s``; a failure is said
    (``say``), never raised."""
    if not (webhook or command):
        return
    payload = json.dumps(summary).encode()
    deadline = time.monotonic() + limit_s
    said = {}
    jobs = []
    if webhook:
        jobs.append(("webhook %s" % shown(webhook), lambda: post(webhook, payload, deadline)))
    if command:
        jobs.append(("command", lambda: run_command(command, payload, summary, deadline, limit_s)))

    def one(name, call):
        try:
            said[name] = call()
        except Exception as exc:  # noqa: BLE001 - a notifier's trouble is said, the run has ended
            said[name] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=one, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 0.5)
    for name, _ in jobs:
        if name not in said:
            say(f"notify: {name} did not answer within {limit_s:g}s (left behind)")
        elif said[name] is not None:
            say(f"notify: {name} failed: {said[name]}")
        else:
            say(f"notify: {name} told ({summary.get('state')})")
