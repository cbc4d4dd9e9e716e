"""One node of a run, seen from the controller: its channels, and the events they make.

A node is driven through two channels on its host's one transport (:mod:`ftbundle.cluster`):

* the **control channel** runs the node program (``ftbundle/remote/node.sh``, mode
  ``node``). Its stdin takes the environment in one write, then a ping a second from the
  supervisor's pinger thread; its stderr brings ``ftb-pid``, the heartbeats and the
  wrapper's messages; its exit status is the job's exit code.
* the **log channel** (rank 0 only) runs ``tail`` on the node's log on shared storage.
  A channel has its own flow-control window, so a node that prints megabytes a second
  can fill this one without delaying a single heartbeat on the other.

The runner owns no state the supervisor decides on: it only emits :class:`Event` values
into the supervisor's queue, and hands rank 0's lines to the display.
"""

from __future__ import annotations

import codecs
import functools
import os
import posixpath
import queue
import re
import threading
import time
from dataclasses import dataclass, field

from .. import gpu_metrics, protocol, shipped
from ..cluster import Cluster, HostUnreachable, Proc, bash_argv, first_line
from ..job import MIN_SECRET_LEN, is_secret, url_passwords
from ..layout import CLAIM_DIR
from ..plan import NodePlan, Plan
from ..protocol import env_payload
from ..rundir import TRAINER_LOG, NodeFiles
from ..runtimes import host_steps_file
from .stall import progress_globs, steps_file
from .storage import STORAGE_SLOW_S

HEARTBEAT_S = 1  # the node says it is alive this often
WATCHDOG_S = 10  # the node stops its job after this long without a ping from the controller
STOP_GRACE_S = 3  # SIGTERM, then SIGKILL after this long
DETACHED_STALE_S = 20  # a detached node's peers stop when its heartbeat file is this old
# Rank 0's log is read by polling it (GNU tail's undocumented option to poll instead of waiting
# on inotify; what it does by itself on NFS), every ``log_poll_s`` of the display it goes to: the
# progress display's 0.2 s, the terminal's (-v) 0.05 s. A node printing 1 MB/s in writes of a
# few KB then reaches the launcher in a few large SSH packets a poll, not a small one a write
# (17,275 packets for 20 MB at 1 MB/s when followed at each write, each costing the launcher
# some 150 us of decrypting, waking threads and handing on: docs/PERFORMANCE.md, chatty rank
# 0). A tail without the option is run as it is. The terminal's queue (display.Display) holds
# a poll's burst at 5 MB/s (2,500 100-byte lines in 0.05 s) with room to spare.
FOLLOW_LOG = 'o=; tail ---disable-inotify --version >/dev/null 2>&1 && o=---disable-inotify; exec tail $o "$@"'
LINE_MAX = 64 * 1024  # a "line" longer than this (no newline in sight) is cut into pieces
PROGRESS_EVERY_S = 1.0  # how often a carriage-return progress bar is shown


def follow_log_argv(path: str, pid: str, *, poll_s: float) -> list[str]:
    """`tail -F` of rank 0's log until ``pid`` is gone, polled every ``poll_s`` (above)."""
    return ["bash", "-c", FOLLOW_LOG, "ftb-log", "-n", "+1", "-F", "-s", f"{poll_s:g}", f"--pid={pid}", "--", path]


NODE_ENV_MARKER = "# -- ftb_env, ftb_env_file_secrets, mode_job: node_env.sh's"


@functools.cache
def program() -> str:
    """The text of the node program (ftbundle/remote/node.sh, shipped in the package), with its
    part on the job's environment and output (node_env.sh) at its marker line."""
    main, part = shipped.read_text("remote", "node.sh"), shipped.read_text("remote", "node_env.sh")
    marker = next(line for line in main.splitlines(keepends=True) if line.startswith(NODE_ENV_MARKER))
    return main.replace(marker, part, 1)


def node_argv(mode: str, *args: str) -> list[str]:
    """`bash -c <node program> ftb MODE ARGS...`"""
    return bash_argv(program(), "ftb", mode, *args)


def stop_argv(files: NodeFiles, node: NodePlan) -> list[str]:
    return node_argv("stop", files.marker, node.container or "")


def node_env(node: NodePlan, plan: Plan, files: NodeFiles, attempt: int, *, detach: bool,
             elapsed: float | None = None) -> dict[str, str]:
    """Everything the node program reads, and the job's own environment after it. ``elapsed``:
    the seconds since the run began (earlier attempts, the restarts between), as its launcher
    counts them: an attached run's rank 0 adds its own when it tells a lost launcher's end
    (None: not a run, a check's load: no word)."""
    passwords = url_passwords(node.env)  # (a URL's password travels as a variable of its own, masked as the rest)
    tells = not detach and node.rank == 0 and elapsed is not None  # (an attached run's rank 0: remote/tell.py)
    control = {
        # every name in the run directory (ftbundle/rundir.py): the node program builds none
        **plan.rundir.env(attempt),
        **files.env(),
        "FTB_REFEREE": "1" if node.rank == 0 else "0",  # a detached run's referee (its watcher)
        "FTB_WORKDIR": node.workdir,
        "FTB_ATTEMPT": str(attempt),
        "FTB_ENV_FILE": node.env_file or "",
        "FTB_PATH_PREPEND": node.path_prepend or "",
        "FTB_CONTAINER": node.container or "",
        "FTB_SECRET_NAMES": " ".join([name for name in node.env if is_secret(name)]
                                     + [f"FTB_URL_SECRET_{i}" for i in range(len(passwords))]),
        **{f"FTB_URL_SECRET_{i}": password for i, password in enumerate(passwords)},
        "FTB_MIN_SECRET_LEN": str(MIN_SECRET_LEN),
        "FTB_WATCHDOG": str(WATCHDOG_S),
        "FTB_HEARTBEAT": str(HEARTBEAT_S),
        "FTB_STOP_GRACE": str(STOP_GRACE_S),
        "FTB_STALE": str(DETACHED_STALE_S),
        "FTB_DETACH": "1" if detach else "0",
        "FTB_CLAIM_DIR": CLAIM_DIR,  # the run's claims on each host (remote/claims.py), released at its end
        # the detached watcher's program, staged beside the run's files (remote/watch.py; launch/staging.py)
        "FTB_WATCHER_PROGRAM": plan.rundir.watcher_program if detach else "",
        "FTB_PROGRESS_FILES": " ".join(progress_globs(plan, node)) if plan.stall_timeout else "",  # (.stall)
        "FTB_STALL_TIMEOUT": str(plan.stall_timeout),
        "FTB_PER_NODE": "1" if node.per_node else "0",  # a `command:` job (no torchrun; .stall, stacks.py)
        "FTB_PROGRESS_STEPS": steps_file(plan, node) if plan.stall_timeout else "",
        "FTB_PROGRESS_EVERY": str(progress_every(plan.stall_timeout)),
        "FTB_SHARED_DIR": plan.shared_dir,  # probed with every progress reading (.storage)
        "FTB_STORAGE_SLOW": str(STORAGE_SLOW_S),
        # each local rank's step times (shims/steptimes.py), read with every heartbeat (ui.stragglers):
        # a file of this host's own, never one on shared storage that could hang the heartbeat
        "FTB_STEPS_FILE": host_steps_file(plan.run_id, node.rank, attempt),
        # a GPU job's GPUs, read by one nvidia-smi loop and sent on this channel (ftbundle.gpu_metrics)
        **gpu_env(plan, node),
        # a detached run's end is judged by rank 0's watcher, or by the first of the others to find it
        # silent (rank 0's host lost); an attached run's whose launcher was lost, by rank 0's node program
        # (remote/tell.py): written into the run directory (ended.aN, what `runs` reads) and told to the
        # job's `notify:` (remote/watch.py end); the job never sees these
        **({"FTB_NODE_HOSTS": " ".join(n.host.name for n in plan.nodes),  # (by node rank: who failed)
            # ... with the run's loss, tokens/s and MFU from the trainer's log (remote/trainer_end.py)
            "FTB_TRAINER_LOG": posixpath.join(plan.checkpoint_dir, TRAINER_LOG) if plan.checkpoint_dir else "",
            "FTB_SPEED": speed_env(plan)} if detach or tells else {}),
        **({"FTB_NOTIFY_WEBHOOK": plan.notify.webhook or "", "FTB_NOTIFY_COMMAND": plan.notify.command or ""}
           if (detach or tells) and plan.notify is not None else {}),
        **({"FTB_TELLER_PROGRAM": plan.rundir.teller_program, "FTB_RUN_ELAPSED": f"{elapsed:.1f}",
            "FTB_SUMMARY_FILE": plan.rundir.summary, "FTB_PLAN_FILE": plan.rundir.plan} if tells else {}),
    }
    return {**control, **node.env}


def speed_env(plan: Plan) -> str:
    """"RANKS MFU_PER_TOKEN_S" (ftbundle.speed): what a detached watcher counts the told figures against."""
    if plan.speed is None:
        return f"{plan.world_size} 0"
    return f"{plan.speed.ranks} {plan.speed.mfu_per_token_s or 0!r}"


def gpu_every_s(plan: Plan) -> float:
    """How often a node reads its GPUs (FTB_GPU_SAMPLE_S here overrides a GPU job's); 0: never."""
    return plan.gpu_sample_s and float(os.environ.get("FTB_GPU_SAMPLE_S") or plan.gpu_sample_s)


def gpu_env(plan: Plan, node: NodePlan) -> dict[str, str]:
    """The GPU sampler's settings: how often (:func:`gpu_every_s`), what, and which GPUs (the
    job's CUDA_VISIBLE_DEVICES on the host runtime; else all)."""
    every = gpu_every_s(plan)
    return {"FTB_GPU_EVERY_MS": str(round(every * 1000)), "FTB_GPU_FIELDS": gpu_metrics.QUERY,
            "FTB_GPU_IDS": "" if node.container else node.env.get("CUDA_VISIBLE_DEVICES", "")}


def progress_every(stall_timeout: int) -> int:
    """How many heartbeats apart a node reads its ranks' progress and probes shared storage
    (one `stat`: the one process a heartbeat would start): stall_timeout / 30, at least every
    beat, at most every 10 s (also with the watchdog off: the storage probe). A stall is then
    named at most that much later than stall_timeout (10 s of the default 600 s), never
    earlier: the clock is reset only by progress seen."""
    if not stall_timeout:
        return 10
    return max(1, min(10, stall_timeout // (30 * HEARTBEAT_S)))


@dataclass
class Event:
    kind: str  # pid | hb | steps | storage | msg | exit | lost | fenced | killed
    rank: int
    text: str = ""
    code: int | None = None
    at: float = field(default_factory=time.monotonic)


# A tqdm bar at the start of a carriage-return segment: "desc:  6%|▋  | 5/80 [00:04<00:37, 2.03it/s]",
# a bar cut short ("Running tokenizer on dataset (num_proc=4):   0%|"), or one without a total
# ("Converting format of dataset: 368 examples [00:00, 16670.67 examples/s]"). tqdm writes "\r" and
# the bar, never a newline: whatever the job prints next (a warning, a log line) is glued to it.
_BAR = re.compile(
    r"(?:[^|\r\n]{0,200}?: *)?(?:"
    r"\s*\d{1,3}%\|[ \u2580-\u259f#0-9]*(?:\|(?:\s*[\d.]+[kMG]?/[\d.]+[kMG]?(?: \[[^\]\r\n]*\])?)?)?"
    r"|\s*[\d.]+[kMG]? \w+(?:/\w+)? \[\d+:\d\d[<,][^\]\r\n]*\])")


def split_bars(text: str) -> tuple[list[str], str, bool]:
    """A line holding carriage returns -> (what the job printed glued after a bar, each piece a
    line of its own; the state a terminal would end on, "" for none; whether that state is a
    bar whose glued text is in the first). No piece of a bar is ever in the first."""
    glued, last, last_glued = [], "", False
    for segment in text.split("\r"):
        if not segment.strip():
            continue
        match = _BAR.match(segment) if "%|" in segment or " [" in segment else None
        if match is not None and segment[match.end():].strip():
            glued.append(segment[match.end():])
            last, last_glued = match.group(0), True
        else:
            last, last_glued = segment, False
    return glued, last, last_glued


class LineSplitter:
    """Bytes in, display lines out: UTF-8 decoded incrementally, carriage-return progress
    bars reduced to their latest state (never a line: a bar's state goes to ``progress``,
    and what the job printed right after a bar, on the same line, is a line of its own),
    memory bounded whatever arrives. A line without a carriage return costs one test."""

    def __init__(self, emit, progress, emit_many=None):
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._pending = ""
        self._emit = emit  # a finished line
        self._progress = progress  # the latest state of a line still being redrawn
        self._emit_many = emit_many  # the finished lines of one read at once, where none was redrawn
        self._last_progress: float | None = None  # (not 0: monotonic time starts at boot)

    def _bar(self, bar: str, final: bool = False) -> None:
        """A bar's state, at most every PROGRESS_EVERY_S (``final``: its last, always)."""
        now = time.monotonic()
        if bar and (final or self._last_progress is None or now - self._last_progress >= PROGRESS_EVERY_S):
            self._last_progress = now
            self._progress(bar)

    def _redrawn(self, line: str, final: bool) -> None:
        """A bar's redraws (``final``: the line ended): text glued after a bar is a line; the
        last state is the line itself once it ended (what a terminal ends on), unless it is a
        bar that text was glued to; else the bar's latest state."""
        glued, last, last_glued = split_bars(line)
        for text in glued:
            self._emit(text)
        if final and not last_glued:
            if last:
                self._emit(last)
        else:
            self._bar(last, final)

    def feed(self, data: bytes) -> None:
        text = self._pending + self._decode(data)
        *lines, rest = text.split("\n")
        if self._emit_many is not None and lines and "\r" not in text:  # one call for a read's lines
            self._emit_many(lines)
        else:
            for line in lines:
                if "\r" in line:  # a bar's redraws, maybe with a line glued after one
                    self._redrawn(line, final=True)
                else:
                    self._emit(line)
        if "\r" in rest:
            done, _, rest = rest.rpartition("\r")
            self._redrawn(done, final=False)
            rest = "\r" + rest  # (still a redraw: what follows on its line may be glued to a bar)
        if len(rest) > LINE_MAX:
            self._emit(rest)
            rest = ""
        self._pending = rest

    def close(self) -> None:
        """The stream ended: a last line without its newline is still a line."""
        rest = self._pending + self._decode(b"", final=True)
        self._pending = ""
        if "\r" in rest:
            self._redrawn(rest, final=True)
        elif rest:
            self._emit(rest)


def display_splitter(display, prefix: str) -> LineSplitter:
    """Rank 0's log into ``display`` (a terminal's Display or the progress feed), each line
    with ``prefix``; a display that has ``lines(prefix, lines)`` gets a read's lines in one
    call where none of them was redrawn."""
    many = getattr(display, "lines", None)
    return LineSplitter(lambda line: display.line(prefix + line), lambda line: display.progress(prefix + line),
                        (lambda lines: many(prefix, lines)) if many is not None else None)


class Gate:
    """Holds node programs at the door while the run directory is staged.

    Their channels open at once (the node program then waits for its environment, the
    start of its stdin, before it does anything), so the channel round trip and the
    host's session setup overlap the staging instead of following it. ``open()`` lets the
    environments go; ``cancel()`` (staging failed or was interrupted) closes the channels,
    and every node program exits without having started anything."""

    def __init__(self):
        self._event = threading.Event()
        self._cancelled = False

    def open(self) -> None:
        self._event.set()

    def cancel(self) -> None:
        self._cancelled = True
        self._event.set()

    def wait(self) -> bool:
        """Block until the gate opens (True) or is cancelled (False)."""
        self._event.wait()
        return not self._cancelled


def start_behind(runners: list[NodeRunner], before) -> None:
    """Start every runner; with ``before`` (staging), the node programs start only after it
    returns. Every node channel opens while it runs (rank 0's beside staging's own channel on
    the same host), so the programs start the moment the gate opens."""
    gate = Gate() if before is not None else None
    for runner in runners:
        runner.start(gate)
    if gate is None:
        return
    try:
        before()
    except BaseException:
        gate.cancel()
        raise
    gate.open()


class NodeRunner:
    """One node of one attempt: starts its program, turns its channels into events."""

    def __init__(self, node: NodePlan, plan: Plan, cluster: Cluster, events: queue.Queue[Event],
                 *, attempt: int = 1, display=None, detach: bool = False, fence: threading.Event | None = None,
                 run_started: float | None = None):
        self.node = node
        self.run_started = run_started  # the run's start (monotonic): its first attempt's, for a lost launcher's word
        self.plan = plan
        self.cluster = cluster
        self.events = events
        self.attempt = attempt
        self.display = display if node.stream else None
        self.detach = detach
        self.files = plan.node_files(node, attempt)
        self.proc: Proc | None = None
        self.log_proc: Proc | None = None
        self._log_thread: threading.Thread | None = None
        self.messages: list[str] = []  # the wrapper's own last words (stderr, not heartbeats)
        self.gpu_host = False  # its node program found nvidia-smi there (ftb-gpu)
        self._started = False  # the environment was sent: the node program runs
        # up once the run's teardown began: a channel that opens later starts nothing
        self.fence = fence or threading.Event()
        self._start_lock = threading.Lock()  # sending the environment vs. the stop at teardown
        self._thread: threading.Thread | None = None

    @property
    def rank(self) -> int:
        return self.node.rank

    def _emit(self, kind: str, text: str = "", code: int | None = None) -> None:
        self.events.put(Event(kind, self.rank, text, code))

    def start(self, gate: Gate | None = None) -> None:
        """Run the node program. With a ``gate``, its channel opens now and the program
        starts only once the gate opens (see :class:`Gate`)."""
        self._thread = threading.Thread(target=self._control, args=(gate,), daemon=True, name=f"node{self.rank}")
        self._thread.start()

    def _control(self, gate: Gate | None) -> None:
        env = node_env(self.node, self.plan, self.files, self.attempt, detach=self.detach,
                       elapsed=time.monotonic() - self.run_started if self.run_started is not None else None)
        try:
            self.proc = self.cluster.start(self.node.host, node_argv("node", *self.node.argv))
        except HostUnreachable as exc:
            if gate is None or gate.wait():
                self._emit("lost", str(exc))
            return
        if gate is not None and not gate.wait():
            self.proc.close()  # the node program reads no environment and exits: nothing ran
            return
        with self._start_lock:
            if self.fence.is_set():  # the teardown began while this channel opened: too late
                self.proc.close()
                self._emit("fenced", f"not started on {self.node.host.name}: the run was already stopping")
                return
            self.proc.send(env_payload(env))
            self._started = True
        pending = b""
        try:
            while chunk := self.proc.read_err():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._on_line(line)
                pending = pending[-LINE_MAX:]
        except (OSError, EOFError) as exc:
            self._emit("lost", f"connection to {self.node.host.name} lost: {first_line(exc)}")
            return
        if pending:
            self._on_line(pending)
        code = self.proc.wait(timeout=5)
        if (code is None or code < 0) and self.cluster.alive(self.node.host):
            # sshd sent exit-signal, not exit-status (paramiko keeps only the latter): the
            # node program was killed, its host answers, its job may still run
            self._emit("killed", f"its node program on {self.node.host.name} was killed by a signal "
                                 "(the host answers; its job is stopped like the others)")
        elif code is None or code < 0:
            self._emit("lost", f"connection to {self.node.host.name} lost (no exit status)")
        else:
            self._emit("exit", code=code)

    def _on_line(self, raw: bytes) -> None:
        line = protocol.parse_line(raw)
        if line.kind == protocol.GPU_LINE:
            self.gpu_host = True
        elif line.kind == protocol.PID_LINE:
            self._emit("pid", line.text)
            if self.display is not None and line.text.isdigit():
                self._start_log(line.text)
        elif line.kind == protocol.MESSAGE:
            self.messages = (self.messages + [line.text])[-5:]
            self._emit("msg", line.text)
        else:  # hb (the ranks' output size), steps, storage
            self._emit(line.kind, line.text)

    # -- rank 0's log, on a channel of its own ----------------------------------------
    def _start_log(self, pid: str) -> None:
        self._log_thread = threading.Thread(target=self._follow_log, args=(pid,), daemon=True,
                                            name=f"log{self.rank}")
        self._log_thread.start()

    def _follow_log(self, pid: str) -> None:
        argv = follow_log_argv(self.files.log, pid, poll_s=self.display.log_poll_s)
        prefix = f"[{self.node.host.name} r{self.rank}] "
        display = self.display
        splitter = display_splitter(display, prefix)
        try:
            self.log_proc = self.cluster.start(self.node.host, argv)
            self.log_proc.close_stdin()
            while chunk := self.log_proc.read_out():
                splitter.feed(chunk)
        except (HostUnreachable, OSError, EOFError):
            pass
        splitter.close()

    def log_drained(self, timeout: float) -> bool:
        """Wait until rank 0's log has been read to its end (tail stops once the job is
        gone); False when it did not within ``timeout``."""
        if self._log_thread is None:
            return True
        self._log_thread.join(timeout)
        return not self._log_thread.is_alive()

    # -- from the supervisor ----------------------------------------------------------
    def unheard(self) -> bool:
        """The node spoke and we have not read it yet (this runner's thread is alive and
        behind: a controller whose threads wait for CPU or the GIL, at 1,024 hosts on 2
        cores): its silence is ours, not the node's."""
        proc = self.proc
        return (proc is not None and proc.unread() and self._thread is not None
                and self._thread.is_alive())

    def ping(self) -> None:
        if self._started:  # (never before the environment: it must be the first line)
            self.proc.send(protocol.PING)

    def close_stdin(self) -> None:
        """The node's watchdog stops the job at once when its stdin closes; ``stop`` first
        tells it that this is the launcher's own decision (it records nothing then)."""
        with self._start_lock:
            if self.proc is not None:
                if self._started:
                    self.proc.send(protocol.STOP_LINE)
                self.proc.close_stdin()

    def stop(self, timeout: float = STOP_GRACE_S + 3) -> bool:
        """Stop the job through a channel of its own (the teardown's second path, for a node
        whose watchdog did not confirm: its node program died, or it is slow);
        True when no process of it is left."""
        try:
            return self.cluster.run(self.node.host, stop_argv(self.files, self.node), timeout=timeout).ok
        except Exception:
            return False

    def drop(self) -> None:
        """Give up on this node's channels (a lost node)."""
        for proc in (self.proc, self.log_proc):
            if proc is not None:
                threading.Thread(target=proc.close, daemon=True).start()
