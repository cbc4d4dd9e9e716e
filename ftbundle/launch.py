"""Fan out a Plan to its hosts, supervise the nodes, tear everything down on failure.

All nodes start at once (a thread per node: Fabric for remote hosts, a local process for
localhost). The supervisor consumes one queue of events from all nodes: rank 0's output
lines (printed with a host/rank prefix), heartbeats, and exits. The first node that
fails, exits non-zero, loses its connection or stops sending heartbeats, makes the
supervisor stop every other node, say which node failed first and why, and print the
end of that node's log. See :mod:`ftbundle.nodescript` for what runs on each node.
"""

from __future__ import annotations

import io
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from . import nodescript
from .job import MIN_SECRET_LEN, is_secret
from .plan import REDACTED, NodePlan, Plan
from .shell import run_script, write_files
from .ssh import connect

HEARTBEAT_TIMEOUT_S = float(os.environ.get("FTB_HEARTBEAT_TIMEOUT", "8"))
PING_INTERVAL_S = 2.0
SETTLE_S = 1.5  # after a first failure, how long to look for an earlier root cause
LOST_EXIT_CODE = 255  # like ssh, for a node whose connection or heartbeat was lost
TAIL_LINES = 20


@dataclass
class Event:
    kind: str  # out | err | hb | exit | lost
    rank: int
    text: str = ""
    code: int | None = None
    at: float = field(default_factory=time.monotonic)


class _LineSink(io.TextIOBase):
    """A write()-able stream that turns chunks into whole lines for a callback."""

    def __init__(self, on_line: Callable[[str], None]):
        self._on_line = on_line
        self._buf = ""

    def write(self, chunk: str) -> int:
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._on_line(line.rstrip("\r"))
        return len(chunk)

    def flush(self) -> None:  # Invoke flushes; partial lines wait for their newline
        pass

    def close_line(self) -> None:
        if self._buf:
            self._on_line(self._buf)
            self._buf = ""


class NodeRunner:
    """One node's wrapper program, running locally or over SSH; reports into ``events``."""

    def __init__(self, node: NodePlan, plan: Plan, events: "queue.Queue[Event]", detach: bool = False):
        self.node = node
        self.plan = plan
        self.events = events
        self.detach = detach
        self.script = nodescript.node_script(node, plan.run_dir, plan.run_id, detach=detach)
        self.last_heartbeat = time.monotonic()
        self.finished = False
        self.exit_code: int | None = None
        self.stderr_tail: list[str] = []
        self._stdin_lock = threading.Lock()

    # -- events --------------------------------------------------------------------------
    def _out(self, line: str) -> None:
        self.events.put(Event("out", self.node.rank, line))

    def _err(self, line: str) -> None:
        self.last_heartbeat = time.monotonic()
        if line == nodescript.HEARTBEAT:
            return
        self.stderr_tail = (self.stderr_tail + [line])[-TAIL_LINES:]
        self.events.put(Event("err", self.node.rank, line))

    def _finish(self, kind: str, code: int | None, text: str = "") -> None:
        self.finished = True
        self.exit_code = code
        self.events.put(Event(kind, self.node.rank, text, code))

    # -- interface -----------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def ping(self) -> None:
        raise NotImplementedError

    def close_stdin(self) -> None:
        raise NotImplementedError

    def run_stop(self) -> None:
        """Stop the node's job through a separate channel (belt and braces)."""
        run_script(self.node.host, nodescript.stop_script(self.node, self.plan.run_id),
                   timeout=nodescript.STOP_GRACE_S + 10, connect_timeout=5)

    def read_file_tail(self, path: str, lines: int) -> list[str] | None:
        result = run_script(self.node.host, f"tail -n {lines} {shlex.quote(path)}", timeout=10,
                            connect_timeout=5)
        return result.stdout.splitlines() if result.ok else None


class LocalRunner(NodeRunner):
    """A node on this machine: the wrapper runs as a child process, no SSH."""

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["bash", "-c", self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        self.proc.stdin.write(nodescript.env_payload(self.node))
        self.proc.stdin.flush()
        readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self._out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self._err), daemon=True),
        ]
        for t in readers:
            t.start()

        def wait() -> None:
            code = self.proc.wait()
            for t in readers:
                t.join()
            self._finish("exit", code)

        threading.Thread(target=wait, daemon=True, name=f"node{self.node.rank}").start()

    @staticmethod
    def _pump(stream, on_line) -> None:
        for raw in iter(stream.readline, b""):
            on_line(raw.decode(errors="replace").rstrip("\n"))

    def ping(self) -> None:
        with self._stdin_lock:
            try:
                self.proc.stdin.write(b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def close_stdin(self) -> None:
        with self._stdin_lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass



class RemoteRunner(NodeRunner):
    """A node over SSH: Fabric runs the wrapper; its stdin is a pipe we ping through."""

    def start(self) -> None:
        read_fd, self._write_fd = os.pipe()
        os.write(self._write_fd, nodescript.env_payload(self.node))
        self._stdin = os.fdopen(read_fd, "rb", buffering=0)
        threading.Thread(target=self._run, daemon=True, name=f"node{self.node.rank}").start()

    def _run(self) -> None:
        out, err = _LineSink(self._out), _LineSink(self._err)
        try:
            conn = connect(self.node.host)
            conn.open()
            conn.transport.set_keepalive(5)
            result = conn.run(
                "bash -c " + shlex.quote(self.script), in_stream=self._stdin, out_stream=out,
                err_stream=err, warn=True, hide=False, pty=False,
            )
        except Exception as exc:  # the connection itself failed: that is this node's failure
            out.close_line()
            err.close_line()
            self._finish("lost", LOST_EXIT_CODE, f"SSH to {self.node.host.address} failed: {exc}")
            return
        out.close_line()
        err.close_line()
        self._finish("exit", result.exited)
        try:
            conn.close()
        except Exception:
            pass

    def ping(self) -> None:
        with self._stdin_lock:
            try:
                os.write(self._write_fd, b"\n")
            except OSError:
                pass

    def close_stdin(self) -> None:
        with self._stdin_lock:
            try:
                os.close(self._write_fd)
            except OSError:
                pass
            self._write_fd = -1



def _local_tail(path: str, lines: int) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return None


def make_runner(node: NodePlan, plan: Plan, events, detach: bool = False) -> NodeRunner:
    cls = LocalRunner if node.host.local else RemoteRunner
    return cls(node, plan, events, detach)


# ---------------------------------------------------------------------------------------
# Staging: the run directory on shared storage


def stage_run_dir(plan: Plan, extra_files: dict[str, str] | None = None) -> None:
    """Create the run directory and write the staged files and plan.json into it.

    Written once, through rank 0's host (or directly when rank 0 is this machine): the
    directory is on shared storage, so every node sees the same files.
    """
    files = dict(plan.files)
    files["plan.json"] = json.dumps(plan.to_dict(redact=True), indent=2) + "\n"
    files.update(extra_files or {})
    write_files(plan.nodes[0].host, plan.run_dir, files)


# ---------------------------------------------------------------------------------------
# Supervision


@dataclass
class Failure:
    rank: int
    host: str
    reason: str
    code: int
    at: float


@dataclass
class Outcome:
    exit_code: int
    failure: Failure | None = None
    interrupted: bool = False
    teardown_s: float | None = None


class Supervisor:
    """Starts every node, streams rank 0, and turns the first failure into a full stop."""

    def __init__(self, plan: Plan, *, out: TextIO | None = None, err: TextIO | None = None,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S):
        self.plan = plan
        self.out = out or sys.stdout  # looked up now, not at import: callers may swap sys.stdout
        self.err = err or sys.stderr
        self.heartbeat_timeout = heartbeat_timeout
        self.events: queue.Queue[Event] = queue.Queue()
        self.runners = [make_runner(n, plan, self.events) for n in plan.nodes]
        # Values of secret variables never reach the terminal, even if a job prints them.
        self.secrets = sorted({v for n in plan.nodes for k, v in n.env.items()
                               if is_secret(k) and len(v) >= MIN_SECRET_LEN},
                              key=len, reverse=True)

    def redact(self, line: str) -> str:
        for value in self.secrets:
            line = line.replace(value, REDACTED)
        return line

    def say(self, message: str) -> None:
        print(f"ftbundle: {message}", file=self.err, flush=True)

    def _print_line(self, runner: NodeRunner, line: str) -> None:
        # Progress bars redraw with carriage returns; show what a terminal would end on.
        if "\r" in line:
            line = next((seg for seg in reversed(line.split("\r")) if seg.strip()), "")
        print(f"[{runner.node.host.name} r{runner.node.rank}] {self.redact(line)}", file=self.out, flush=True)

    def run(self) -> Outcome:
        for runner in self.runners:
            runner.start()
        try:
            return self._loop()
        except KeyboardInterrupt:
            self.say("interrupted: stopping every node")
            started = time.monotonic()
            self._teardown(lost=set())
            took = time.monotonic() - started
            self.say(f"all nodes stopped in {took:.1f}s")
            return Outcome(130, interrupted=True, teardown_s=took)

    def _loop(self) -> Outcome:
        failures: list[Failure] = []
        first_failure_at: float | None = None
        next_ping = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_ping:
                for r in self.runners:
                    if not r.finished:
                        r.ping()
                next_ping = now + PING_INTERVAL_S
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                event = None
            if event is not None:
                failure = self._handle(event)
                if failure:
                    failures.append(failure)
                    first_failure_at = first_failure_at or time.monotonic()
            now = time.monotonic()
            for r in self.runners:
                silent = now - r.last_heartbeat
                if not r.finished and silent > self.heartbeat_timeout:
                    r.finished = True  # given up on: no more waiting for it
                    failures.append(Failure(
                        r.node.rank, r.node.host.name,
                        f"no heartbeat for {silent:.0f}s (host down or network cut?)",
                        LOST_EXIT_CODE, r.last_heartbeat))
                    first_failure_at = first_failure_at or now
            if first_failure_at is not None and now - first_failure_at >= SETTLE_S:
                return self._fail(failures)
            if all(r.finished for r in self.runners) and not failures:
                return Outcome(0)

    def _handle(self, event: Event) -> Failure | None:
        runner = self.runners[event.rank]
        if event.kind == "out":
            if runner.node.stream:
                self._print_line(runner, event.text)
        elif event.kind == "err":
            self._print_line(runner, event.text)
        elif event.kind == "exit" and event.code != 0:
            return Failure(event.rank, runner.node.host.name, f"exited with code {event.code}",
                           event.code, event.at)
        elif event.kind == "lost":
            return Failure(event.rank, runner.node.host.name, event.text, LOST_EXIT_CODE, event.at)
        return None

    def _root_cause(self, failures: list[Failure]) -> Failure:
        """The earliest failure, where a silent node counts from its last heartbeat: when a
        host dies, its peers' exits ("connection reset") follow it by seconds."""
        now = time.monotonic()
        for r in self.runners:
            silent = now - r.last_heartbeat
            if not r.finished and silent > 2.0:
                failures.append(Failure(r.node.rank, r.node.host.name,
                                        f"no heartbeat for {silent:.1f}s (host down or network cut?)",
                                        LOST_EXIT_CODE, r.last_heartbeat))
        return min(failures, key=lambda f: f.at)

    def _fail(self, failures: list[Failure]) -> Outcome:
        first = self._root_cause(failures)
        lost = {f.rank for f in failures if f.code == LOST_EXIT_CODE}
        node = self.plan.nodes[first.rank]
        self.say(f"node {first.host} (rank {first.rank}, {node.host.address}) failed first: {first.reason}")
        others = [f for f in failures if f.rank != first.rank]
        for f in sorted(others, key=lambda f: f.at):
            self.say(f"  then {f.host} (rank {f.rank}): {f.reason}")
        started = time.monotonic()
        self._teardown(lost)
        took = time.monotonic() - started
        still = [r.node.host.name for r in self.runners if r.node.rank in lost]
        self.say(f"stopped the other nodes in {took:.1f}s"
                 + (f"; could not reach {', '.join(still)} (its own watchdog stops its job "
                    f"within {nodescript.WATCHDOG_S}s of losing the controller)" if still else ""))
        self._print_log_tail(first.rank)
        return Outcome(first.code, first, teardown_s=took)

    def _teardown(self, lost: set[int]) -> None:
        """Close every node's stdin (its watchdog stops the job at once), stop the jobs
        through a second channel as well, and wait for the reachable nodes to end."""
        for r in self.runners:
            r.close_stdin()
        stoppers = []
        for r in self.runners:
            if r.node.rank in lost:
                continue
            t = threading.Thread(target=_quietly, args=(r.run_stop,), daemon=True)
            t.start()
            stoppers.append(t)
        deadline = time.monotonic() + nodescript.STOP_GRACE_S + 4
        waiting = [r for r in self.runners if r.node.rank not in lost]
        while time.monotonic() < deadline and not all(r.finished for r in waiting):
            try:
                event = self.events.get(timeout=0.1)
                if event.kind == "out" and self.runners[event.rank].node.stream:
                    self._print_line(self.runners[event.rank], event.text)
            except queue.Empty:
                pass
        for t in stoppers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _print_log_tail(self, rank: int) -> None:
        node = self.plan.nodes[rank]
        lines = _local_tail(node.log_path, TAIL_LINES)
        if lines is None:
            # The log is on shared storage: any reachable node can read it.
            for r in [self.runners[rank]] + [x for x in self.runners if x.node.rank != rank]:
                try:
                    lines = r.read_file_tail(node.log_path, TAIL_LINES)
                except Exception:
                    lines = None
                if lines is not None:
                    break
        if lines is None:
            self.say(f"could not read {node.log_path}")
            return
        self.say(f"last {len(lines)} lines of {node.log_path}:")
        for line in lines:
            print(f"  | {self.redact(line)}", file=self.err)
        stderr_tail = self.runners[rank].stderr_tail
        if stderr_tail:
            self.say("node wrapper said: " + self.redact(" / ".join(stderr_tail[-3:])))


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        pass
