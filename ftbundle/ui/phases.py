"""The run as a person watches it: checking, staging, launching, training, then a summary.

On a terminal a rich live line shows the current phase (and while training: step/total,
epoch, the last loss logged, learning rate, samples/s, elapsed, ETA, nodes alive) and finished
phases stay above it as one line each. Anywhere else (a pipe, a file, CI) the same appears
as plain lines, with no carriage returns and at most one progress line per logging step
and per ``PLAIN_EVERY_S``. Every method is safe to call from any thread.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import TextIO

from .progress import Progress, stage_name, startup_text, status_fields

PLAIN_EVERY_S = 5.0  # plain output: a progress line at most this often
MAX_WARNINGS = 20  # distinct warnings shown from rank 0's log before the rest are only counted
_WARNING = re.compile(r"\bwarn(ing)?\b", re.I)
# Python's warnings module prints a warning as "path.py:271: UserWarning: text", then the
# source line that warned, indented ("  warnings.warn("); the runner's "[host r0] " and
# torch's "[rank0]:" may come first
_PY_WARNING = re.compile(r"^(?:\[[^\]]*\] )?(?:\[\w+\]:)?\S[^:]*:\d+: [A-Z]\w*Warning: ")
_WARN_CALL = re.compile(r"^\s+(?:warnings\.)?warn(?:_explicit)?\(")  # a warning call's source line
_VOLATILE = re.compile(r"\d+([.:,-]\d+)*")
# Libraries' notices that reach every run and that nothing in the job can change, or that mean
# something else here: said with what they mean (shown once, as every warning)
NOTICES = (
    ("We recommend enable mixed precision training.",
     "LlamaFactory's advice when neither bf16 nor fp16 is set: on GPUs set bf16: true (the check says whether "
     "they have it); a CPU job trains in float32 and has nothing to change"),
    ("`torch_dtype` is deprecated! Use `dtype` instead!",
     "said by transformers of LlamaFactory's own call, not of your config: nothing to change"),
    ("mtime may not be reliable on this filesystem, falling back to numerical ordering",
     "said by transformers when the checkpoints it keeps were saved less than a second apart (a small model, or "
     "storage that keeps no times): it keeps the newest by their step numbers instead, which is right: nothing "
     "to change"),
)


def explained(line: str) -> str:
    """A warning line with what it means here, when it is one of the known NOTICES."""
    for said, meaning in NOTICES:
        if said in line:
            return f"{line}  [ftbundle: {meaning}]"
    return line


def _text(line: str) -> str:
    """A rank 0 line without the runner's "[host r0] " prefix."""
    if line.startswith("["):
        end = line.find("] ")
        if end >= 0:
            return line[end + 2:]
    return line


def may_warn(text: str) -> bool:
    """False for text (a line, or many lines at once) in which no warning can be: no "warn"
    in any case."""
    return "warn" in text.lower()


def warning_key(line: str) -> str | None:
    """A warning line with its numbers (timestamps, ranks, pids) taken out, so the same
    warning from two ranks or two steps is one; None for a line that is not a warning, and
    for the source line of a Python warning (``  warnings.warn(``), which is not one by itself.
    (The substring test first: it lets nearly every line of a chatty rank 0 go for a tenth
    of the regexes' cost, and no line without "warn" in some case can match them.)"""
    if not may_warn(line):
        return None
    if not _PY_WARNING.search(line) and (not _WARNING.search(line) or _WARN_CALL.match(_text(line))):
        return None
    return _VOLATILE.sub("#", line).strip()


def is_python_warning(line: str) -> bool:
    """The first line of a warning printed by Python's warnings module."""
    return _PY_WARNING.search(line) is not None


class Phases:
    """The display of one ``ftbundle run``. ``tty=None``: a terminal if ``stream`` is one."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, nnodes: int = 1):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.nnodes = nnodes
        self.alive = 0
        self.finished = 0  # nodes whose job exited 0
        self.phase = ""
        self.detail = ""
        self.progress: Progress | None = None
        self._phase_started = time.monotonic()
        self._lock = threading.RLock()
        self._warnings: set[str] = set()
        self.warnings_hidden = 0
        self._in_py_warning = False  # the last line was a Python warning's: its source line may follow
        self._last_plain = 0.0
        self._last_plain_step: int | None = None
        self._last_plain_said: tuple | None = None  # what the last plain progress line said (but the clocks)
        self._last_plain_stage: str | None = None
        self._startup_said = False  # the start-up's parts, said once the first step is seen
        self._live = None
        self._console = None
        if self.tty:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False, force_terminal=True)

    # -- output -----------------------------------------------------------------------
    def print(self, text: str) -> None:
        """A line that stays (above the live line on a terminal)."""
        with self._lock:
            if self._console is not None:
                self._console.print(text, markup=False, soft_wrap=True)
            else:
                try:
                    self.stream.write(text.replace("\r", "") + "\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass

    def say(self, text: str) -> None:
        self.print(f"ftbundle: {text}")

    def _render(self):
        """The live lines: the phase with its spinner (and while training, a bar, step/total,
        epoch, elapsed, ETA), then the numbers (loss, lr, samples/s, nodes alive)."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        grid = Table.grid(padding=(0, 1))
        row = [Spinner("dots", style="cyan"), Text(self.phase, style="bold")]
        p = self.progress
        if self.phase == "training" and p is not None and p.known:
            fields = dict(status_fields(p, self.alive, self.nnodes, finished=self.finished))
            if p.total:
                row.append(ProgressBar(total=p.total, completed=p.step or 0, width=24))
            first, second = Text(), Text("  ")
            for label in ("step", "epoch", "elapsed", "eta"):
                if label in fields:
                    first.append(f"{label} ", style="dim").append(f"{fields[label]}  ")
            for label in ("loss", "lr", "samples/s", "it/s", "tok/s", "mfu", "GPU", "nodes", "slowest"):
                if label in fields:
                    second.append(f"{label} ", style="dim").append(f"{fields[label]}  ")
            row.append(first)
            grid.add_row(*row)
            return Group(grid, second)
        detail = self.detail
        now = time.monotonic()
        took = f"{now - self._phase_started:.0f}s"
        if self.phase == "training" and p is not None and p.stage:
            detail = p.stage  # a phrase, never a raw line of the log
            if p.stages:  # (this stage's own time, then the whole wait's)
                took = f"{now - p.stages[-1][1]:.0f}s  ({now - p.started:.0f}s since launch)"
        row.append(Text(f"{detail}  {took}", style="dim", no_wrap=True, overflow="ellipsis"))
        grid.add_row(*row)
        return grid

    def _show(self) -> None:
        """On a terminal: (re)start the live line. Plain: nothing until there is news."""
        if self._console is None:
            return
        if self._live is None:
            from rich.live import Live

            self._live = Live(get_renderable=self._render, console=self._console, refresh_per_second=4,
                              transient=True, redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        else:
            self._live.refresh()

    def stop(self) -> None:
        """Take the live line down (before a summary, or anything else printed for good)."""
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    def _enter(self, phase: str, detail: str = "", plain: str | None = None) -> None:
        """``plain``: the line said when the phase begins, without a terminal."""
        with self._lock:
            if phase != self.phase:
                self._phase_started = time.monotonic()
                self.phase = phase
                self.detail = detail
                if self._console is None:
                    self.say(plain or f"{phase} {detail}".strip())
            else:
                self.detail = detail
            self._show()

    # -- phases -----------------------------------------------------------------------
    def checking(self, done: int, total: int) -> None:
        with self._lock:
            self._enter("checking", f"hosts {done}/{total}", plain=f"checking {total} host(s)")

    def hashing(self, line: str) -> None:
        """The check's files being hashed on the hosts (a node-local model: check/bytes_rules.py)."""
        with self._lock:
            if self._console is None:  # (a line each time, not the phase's one line)
                self.say(line)
            else:
                self._enter("checking", line)

    def staging(self) -> None:
        self._enter("staging", "run directory and configs on shared storage",
                    plain="staging the run directory on shared storage")

    def launching(self, alive: int, total: int) -> None:
        with self._lock:
            self.alive, self.nnodes = alive, total
            first = self.phase != "launching"
            self._enter("launching", f"nodes up {alive}/{total}", plain=f"launching on {total} node(s)")
            if self._console is None and not first and alive == total:
                self.say(f"launching: all {total} node(s) up")

    def training(self, progress: Progress, alive: int | None = None, finished: int | None = None) -> None:
        """Called whenever something changed (a metric, a node); cheap. ``finished``: nodes
        whose job exited 0 (shown as finished, not as gone)."""
        with self._lock:
            self.progress = progress
            if alive is not None:
                self.alive = alive
            if finished is not None:
                self.finished = finished
            if self.phase != "training":
                self._enter("training", "starting the ranks", plain="training: ranks starting")
                return
            if progress.known and not self._startup_said:
                self._startup_said = True
                parts = progress.startup()
                if parts:  # once: where the wait for the first step went (also in the summary)
                    self.say("before the first step " + startup_text(parts))
            if self._console is not None:
                return  # the live line redraws itself
            if not progress.known:
                if progress.stage and progress.stage != self._last_plain_stage:
                    self._last_plain_stage = progress.stage
                    took = ""
                    if len(progress.stages) == 1:  # (the first: how long the start took, imports included)
                        took = f"  ({progress.stages[0][1] - progress.started:.1f} s since launch" + (
                            f", imports {progress.import_s:.1f} s of it)" if progress.import_s is not None else ")")
                    elif len(progress.stages) >= 2:  # (the stage before this one, and its time)
                        (before, began), (_, ended) = progress.stages[-2], progress.stages[-1]
                        took = f"  ({stage_name(before)}: {ended - began:.1f} s)"
                    self.say(f"training: {progress.stage}{took}")
                return
            now = time.monotonic()
            if progress.step == self._last_plain_step or now - self._last_plain < PLAIN_EVERY_S:
                return
            self._plain_progress(progress, now)

    def _plain_progress(self, p: Progress, now: float) -> None:
        fields = status_fields(p, self.alive, self.nnodes, now, self.finished)
        self._last_plain, self._last_plain_step = now, p.step
        self._last_plain_said = tuple(field for field in fields if field[0] not in ("elapsed", "eta"))
        self.say("training: " + "  ".join(f"{k} {v}" for k, v in fields))

    def final_progress(self) -> None:
        """The last progress line in plain mode, unless the last one shown said it all
        already: the run's final figures (the trainer's closing samples/s, the nodes
        finished) are the last line's, as they are the summary's."""
        with self._lock:
            p = self.progress
            if self._console is None and p is not None and p.known:
                now = time.monotonic()
                said = tuple(f for f in status_fields(p, self.alive, self.nnodes, now, self.finished)
                             if f[0] not in ("elapsed", "eta"))
                if said != self._last_plain_said:
                    self._plain_progress(p, now)

    def warning(self, line: str) -> bool:
        """A line of rank 0's log: shown once if it is a warning; True when it was one. A
        Python warning is shown by its first line (where and what); the indented source
        line after it is part of it, never shown (``  warnings.warn(`` says nothing)."""
        key = warning_key(line)
        if key is None and not self._in_py_warning:  # (nearly every line: no lock taken)
            return False
        with self._lock:
            follows, self._in_py_warning = self._in_py_warning, False
            # (a source line may hold "warn" itself: `  warnings.warn("x is deprecated", FutureWarning)`)
            if key is None or follows and _text(line)[:1].isspace():
                return False
            self._in_py_warning = is_python_warning(line)
            if key in self._warnings:
                return True
            if len(self._warnings) >= MAX_WARNINGS:
                self.warnings_hidden += 1
                return True
            self._warnings.add(key)
        self.print(explained(line))
        return True

    def done(self, lines: list[str]) -> None:
        """The closing (or failure) summary: the live line goes, the summary stays."""
        self.stop()
        for line in lines:
            self.print(line)
