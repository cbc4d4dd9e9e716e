"""A word when a run ends (issue 47 item 3): ftbundle/notify.py against a real local HTTP server
and a real shell: one POST of the summary, a failing webhook retried then named, a hanging one
named within the limit, the URL's secret never printed; the job key's bad values refused."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from ftbundle import notify as N
from ftbundle.errors import UserError
from ftbundle.job import parse_job


class Hook:
    """An HTTP server on 127.0.0.1 (or ``address``: a test network's gateway, for its hosts) that keeps every POST; ``status`` what it answers, ``hang``:
    it reads the request and never answers."""

    def __init__(self, status: int = 200, hang: bool = False, address: str = "127.0.0.1"):
        self.posts: list[tuple[str, dict]] = []
        self.release = threading.Event()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts.append((self.path, json.loads(body)))
                if hang:
                    hook.release.wait(30)
                    return
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{address}:{self.server.server_port}/services/T000/B000/SECRETTOKEN"

    def close(self):
        self.release.set()
        self.server.shutdown()


@pytest.fixture
def hook():
    made = []

    def make(**kw) -> Hook:
        made.append(Hook(**kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


SUMMARY = {"run_id": "j-20261129-010203-abcd", "state": "finished", "exit_code": 0, "hosts": ["node0", "node1"],
           "final_loss": 1.25, "tokens_per_s": 1234.5}


def test_one_post_of_the_summary_and_the_url_is_said_without_its_secret(hook):
    h = hook()
    said: list[str] = []
    N.send(N.Notify(webhook=h.url), SUMMARY, said.append)
    assert h.posts == [("/services/T000/B000/SECRETTOKEN", SUMMARY)]
    assert said == [f"notify: webhook http://127.0.0.1:{h.server.server_port}/... told (finished)"]
    assert N.shown("https://user:pw@hooks.example.com/x?token=abc") == "https://hooks.example.com/..."


def test_a_failing_webhook_is_retried_then_named_and_a_client_error_is_not_retried(hook, monkeypatch):
    monkeypatch.setattr(N, "RETRY_PAUSE_S", 0.05)
    h = hook(status=503)
    said: list[str] = []
    N.send(N.Notify(webhook=h.url), SUMMARY, said.append)
    assert len(h.posts) == N.TRIES and said == [f"notify: webhook {N.shown(h.url)} failed: HTTP 503 (3 tries)"]
    h = hook(status=404)
    said.clear()
    N.send(N.Notify(webhook=h.url), SUMMARY, said.append)
    assert len(h.posts) == 1 and said == [f"notify: webhook {N.shown(h.url)} failed: HTTP 404"]
    assert not any("SECRETTOKEN" in line for line in said)


def test_a_hanging_webhook_does_not_hold_the_end_longer_than_its_limit(hook):
    h = hook(hang=True)
    said: list[str] = []
    began = time.monotonic()
    N.send(N.Notify(webhook=h.url), SUMMARY, said.append, limit_s=2)
    took = time.monotonic() - began
    assert took < 3.5, took
    assert len(said) == 1 and said[0].startswith(f"notify: webhook {N.shown(h.url)} ")
    assert ("did not answer within 2s" in said[0] or "failed: no answer within the time left" in said[0]), said


def test_the_command_gets_the_summary_on_stdin_and_its_failure_is_named(tmp_path):
    out = tmp_path / "got.json"
    said: list[str] = []
    N.send(N.Notify(command=f'cat > {out}; echo "$FTB_RUN_ID $FTB_STATE $FTB_EXIT_CODE" >> {out}.env'),
           SUMMARY, said.append)
    assert json.loads(out.read_text()) == SUMMARY
    assert (tmp_path / "got.json.env").read_text() == "j-20261129-010203-abcd finished 0\n"
    assert said == ["notify: command told (finished)"]
    said.clear()
    N.send(N.Notify(command="echo no route to pager >&2; exit 4"), SUMMARY, said.append)
    assert said == ["notify: command failed: exit 4: no route to pager"]
    said.clear()
    began = time.monotonic()
    N.send(N.Notify(command="sleep 30"), SUMMARY, said.append, limit_s=1)
    assert time.monotonic() - began < 3 and said == ["notify: command failed: did not end within 1s (left running)"]


@pytest.mark.parametrize("value, key", [
    ({"webhook": "ftp://x/y"}, "notify.webhook"), ({"webhook": "not a url"}, "notify.webhook"),
    ({"command": " "}, "notify.command"), ({"email": "me@x"}, "notify.email"), ("https://x", "notify"),
    ({}, "notify")])
def test_bad_notify_values_are_refused_naming_the_key(tmp_path, value, key):
    with pytest.raises(UserError) as caught:
        parse_job({"name": "j", "shared_dir": "/s", "train": {"command": "true"}, "notify": value}, tmp_path / "job.yaml")
    assert caught.value.key == key, caught.value
    job = parse_job({"name": "j", "shared_dir": "/s", "train": {"command": "true"},
                     "notify": {"webhook": "https://hooks.example.com/T/B/X", "command": "true"}}, tmp_path / "job.yaml")
    assert job.notify == N.Notify(webhook="https://hooks.example.com/T/B/X", command="true")
