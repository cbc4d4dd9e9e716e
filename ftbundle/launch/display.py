"""Rank 0's output on the terminal: never a reason for anything else to wait.

Lines arrive from the log channel's reader; a printer thread of its own writes them out.
The queue between them is bounded: when the terminal (or whatever reads our stdout) falls
behind, the oldest waiting lines are dropped and one line says how many, and where the
whole log is. Nothing upstream ever blocks on the terminal, so a slow pipe cannot delay a
heartbeat, a ping or a teardown. The full log is on shared storage regardless.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

from ..ui.phases import may_warn

CAPACITY = 8000  # lines waiting for the terminal before the oldest are dropped (a poll's burst is 2,500 at 5 MB/s)
BATCH = 512  # lines written per write() call


class Display:
    log_poll_s = 0.05  # rank 0's log is read this often (node.follow_log_argv): a burst fits the queue

    def __init__(self, out: TextIO, *, redact: Callable[[str], str] = lambda s: s,
                 log_hint: str = "", capacity: int = CAPACITY):
        self.out = out
        self.redact = redact
        self.log_hint = log_hint
        self.capacity = capacity
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self._lines: deque[str] = deque()
        self._progress: str | None = None  # a progress bar's latest state, not yet shown
        self._dropped = 0
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._shown_progress = False  # on a tty: the cursor sits at the end of a bar
        self.lines_shown = 0
        self.lines_dropped = 0
        self._thread = threading.Thread(target=self._print, daemon=True, name="display")
        self._thread.start()

    # -- producers (any thread; never block) ------------------------------------------
    def line(self, text: str) -> None:
        with self._cond:
            if len(self._lines) >= self.capacity:
                self._lines.popleft()
                self._dropped += 1
            self._lines.append(text)
            self._progress = None
            self._cond.notify()

    def lines(self, prefix: str, lines: list[str]) -> None:
        """Many lines at once (what the runner read in one go, none redrawn): as many
        :meth:`line` calls, under one lock and one wake-up."""
        with self._cond:
            excess = len(self._lines) + len(lines) - self.capacity
            if excess > 0:  # the oldest go first: those waiting, then the first of these
                self._dropped += excess
                waiting = min(excess, len(self._lines))
                for _ in range(waiting):
                    self._lines.popleft()
                lines = lines[excess - waiting:]
            self._lines.extend(prefix + text for text in lines)
            self._progress = None
            self._cond.notify()

    def progress(self, text: str) -> None:
        with self._cond:
            self._progress = text
            self._cond.notify()

    # -- the printer ------------------------------------------------------------------
    def _print(self) -> None:
        while True:
            with self._cond:
                while not self._lines and self._progress is None and not self._dropped and not self._closed:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                if self._closed and not self._lines and self._progress is None and not self._dropped:
                    self._busy = False
                    self._cond.notify_all()
                    return
                self._busy = True
                dropped, self._dropped = self._dropped, 0
                batch = [self._lines.popleft() for _ in range(min(BATCH, len(self._lines)))]
                bar, self._progress = (self._progress, None) if not self._lines else (None, self._progress)
            self._write(dropped, batch, bar)

    def _write(self, dropped: int, batch: list[str], bar: str | None) -> None:
        parts = []
        if (dropped or batch) and self._shown_progress:
            parts.append("\n")
            self._shown_progress = False
        if dropped:
            self.lines_dropped += dropped
            parts.append(f"[ftbundle] ... {dropped} line(s) not shown: the terminal fell behind"
                         + (f" (full log: {self.log_hint})" if self.log_hint else "") + "\n")
        for text in batch:
            parts.append(self.redact(text) + "\n")
        self.lines_shown += len(batch)
        if bar is not None:
            if self.tty:
                parts.append("\r\x1b[K" + self.redact(bar))
                self._shown_progress = True
            else:
                parts.append(self.redact(bar) + "\n")
        try:
            self.out.write("".join(parts))
            self.out.flush()
        except (OSError, ValueError):
            pass

    # -- end --------------------------------------------------------------------------
    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued has been written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._busy and not self._lines and self._progress is None and not self._dropped,
                timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._shown_progress:
            try:
                self.out.write("\n")
                self.out.flush()
            except (OSError, ValueError):
                pass


def _body(text: str) -> str:
    """A rank 0 line without the runner's "[host r0] " prefix."""
    if text.startswith("["):
        end = text.find("] ")
        if end >= 0:
            return text[end + 2:]
    return text


QUIET_CHANGE_S = 0.5  # lines that told nothing new: the display is still told at most this often


class ProgressFeed:
    """Rank 0's output turned into progress instead of printed (the default without -v).

    Same interface as :class:`Display` for the node runner: every line is folded into a
    :class:`~ftbundle.ui.progress.Progress`; a warning is shown once through the UI; the
    rest stays in the node's log on shared storage (`ftbundle logs`, or `run -v`).

    ``on_change`` runs after a line that told something (a step, a loss, a stage), and
    otherwise at most every QUIET_CHANGE_S (a plain display's timed line): not once per line
    of a rank 0 that prints ten thousand a second."""

    log_poll_s = 0.2  # no queue: rank 0's log is read this often (node.follow_log_argv)

    def __init__(self, ui, progress, on_change: Callable[[], None]):
        self.ui = ui
        self.state = progress
        self.on_change = on_change
        self._lock = threading.Lock()
        self.lines_seen = 0
        self._last_change = 0.0

    def _changed(self, told: bool) -> None:
        now = time.monotonic()
        if told or now - self._last_change >= QUIET_CHANGE_S:
            self._last_change = now
            self.on_change()

    def line(self, text: str) -> None:
        body = _body(text)
        with self._lock:
            self.lines_seen += 1
            told = self.state.feed_line(body)
        self.ui.warning(text)
        self._changed(told)

    def lines(self, prefix: str, lines: list[str]) -> None:
        """Many lines at once (what the runner read in one go, none redrawn). Joined, they
        are searched once for anything the progress or the warnings could take from a line;
        where nothing is, they are counted and the last kept, without a call per line (a
        chatty rank 0's 10,000 lines a second); else each goes through :meth:`line`."""
        if not lines:
            return
        block = "\n".join(lines)
        if self.state.may_tell(block) or may_warn(block):
            for text in lines:
                self.line(prefix + text)
            return
        with self._lock:
            self.lines_seen += len(lines)
            self.state.quiet_lines(lines)
        self.ui.warning(prefix + lines[0])  # (ends a Python warning's source line, as line() would)
        self._changed(False)

    def progress(self, text: str) -> None:
        """A carriage-return bar's latest state (tqdm: step/total)."""
        with self._lock:
            self.state.feed_line(_body(text))
        self.on_change()  # (at most once a second: the runner's splitter)

    def record(self, line: str) -> None:
        """A line of LlamaFactory's trainer_log.jsonl."""
        from ..ui.progress import parse_trainer_log

        record = parse_trainer_log(line)
        if record is not None:
            with self._lock:
                self.state.feed_record(record)
            self.on_change()

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        pass
