"""An attached run whose launcher was lost, told by rank 0's node program as its launcher would have.

Every node stops its job when its launcher is gone (node.sh's watchdog: its connection closed, or
no ping for FTB_WATCHDOG seconds: the laptop that started it went to sleep, its machine died) and
writes why beside its exit file. Nobody else is left to say that the run ended: no summary.json,
no webhook. So rank 0's node program (FTB_REFEREE=1) starts this, in a session of its own, once
its job is stopped: ``python3 -I -S TELLER SECONDS``, SECONDS the node program's own since it began
(with the launcher's count up to then, FTB_RUN_ELAPSED: the run's duration, no host's clock against
another's). Why the job stopped is read from FTB_STOPPED_FILE: none, or not "launcher lost" (a stop
its launcher asked for) and it says nothing. It waits GRACE_S: a launcher lost
to this host alone (the network between them) is alive and writes summary.json and tells the run's
end itself; then, with none there, it writes what `ftbundle runs` and `status` read of a run no
launcher saw end (FTB_ENDED_FILE, ended.aN: state, duration, loss, tokens/s and MFU from the
trainer's log, as a detached run's watcher writes it: remote/watch.py ``end``), and tells the job's
``notify:`` once (FTB_NOTIFY_WEBHOOK, FTB_NOTIFY_COMMAND: given to rank 0's node program, never to
the job). Once: the first to create FTB_ENDED_FILE (O_EXCL) tells.

Shipped as one text: watch_host.py's (the file helpers), notifier.py's, trainer_end.py's, then this
file's (launch/stall.py ``TELL_PARTS``); standard library only.
"""

import json
import os
import sys
import time

if __package__:  # imported (tests); shipped, the parts' texts come before this one
    from .notifier import send
    from .trainer_end import earlier_run, read_ends, told_figures
    from .watch_host import append, claim_once, write_whole

GRACE_S = 20.0  # a launcher alive but cut off from this host writes summary.json well within this


def figures(env, plan_mtime):
    """The run's hosts, loss, tokens/s (per rank) and MFU from its trainer's log, as `runs` counts
    them (None where there is no log of this run: a script's, a log left by an earlier run)."""
    log = env.get("FTB_TRAINER_LOG") or ""
    records = []
    if log:
        try:
            records = [] if earlier_run(os.stat(log).st_mtime, plan_mtime) else read_ends(log)
        except OSError:
            records = []
    return told_figures(records, env.get("FTB_SPEED"), env.get("FTB_NODE_HOSTS"))


def tell(env, why, elapsed_s, grace_s=GRACE_S, now=time.time):
    """Write the run's end and tell it, unless its launcher did or another teller does: True
    when this one told."""
    time.sleep(grace_s)
    if os.path.exists(env.get("FTB_SUMMARY_FILE") or ""):  # (the launcher lived: its summary and its word are the run's)
        return False
    ended = env.get("FTB_ENDED_FILE") or ""
    host = os.uname()[1]
    if not ended or not claim_once(ended, host):
        return False
    try:
        plan_mtime = os.stat(env.get("FTB_PLAN_FILE") or "").st_mtime
    except OSError:
        plan_mtime = 0.0
    since = elapsed_s + grace_s  # (the job was stopped before the wait)
    summary = {"run_id": env.get("FTB_RUN_ID") or "", "detached": False,
               "started": round(now() - since, 3), "duration_s": round(elapsed_s, 1),
               "nnodes": int(env.get("NNODES") or 1), **figures(env, plan_mtime),
               "state": "stopped: launcher lost", "exit_code": None, "failed_host": None,
               "failure": {"host": host, "line": why}, "told_by": host}
    write_whole(ended, json.dumps(summary))
    webhook, command = env.get("FTB_NOTIFY_WEBHOOK") or "", env.get("FTB_NOTIFY_COMMAND") or ""
    if webhook or command:
        log = env.get("FTB_LOG") or ""
        send(webhook, command, summary, lambda line: append(log, "ftbundle: " + line) if log else None)
    return True


def main(argv):
    env = dict(os.environ)
    try:
        with open(env.get("FTB_STOPPED_FILE") or "", encoding="utf-8", errors="replace") as f:
            why = f.readline().strip()
    except OSError:
        return 0
    if not why.startswith("launcher lost"):
        return 0
    try:
        elapsed = float(env.get("FTB_RUN_ELAPSED") or 0) + float(argv[1] if len(argv) > 1 else 0)
    except ValueError:
        elapsed = 0.0
    tell(env, why, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
