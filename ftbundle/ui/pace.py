"""Has the run slowed? Its recent pace against its own, while it goes. Pure.

A week-long run's tokens/s is a mean since its first step: a whole fleet slowing by half for its
last hour (a congested network, shared storage feeding the input slowly, another job on the
hosts) moves that mean by a fraction of a percent, and the straggler rule names nothing when
every node slowed alike. So the trainer's own clock (trainer_log.jsonl's elapsed time, whole
seconds) and count (its tokens, else its steps) are cut into chunks of at least ``chunk_s`` of
its time, each with its rate; the median rate of the chunks in the last ``window_s`` (at least
:data:`MIN_CHUNKS` of them) is the run's pace now, and the median of the chunks before it (the
first :data:`WARMUP_CHUNKS` left out: compile, caches, the first batches) its pace before.
Medians, so that a checkpoint's save or an evaluation inside one chunk is no slowdown.

The run is said to have slowed when its pace now is under :data:`SLOW` of its pace before, and
back when it is again at :data:`BACK` of that (the pace before as it was when the slowdown began:
a long slowdown does not become the norm it is judged by). Each is said once.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass

from ..remote.trainer_end import trainer_seconds  # noqa: F401 (progress.py takes it from here)

# the pace now: the trainer's last five minutes (FTB_PACE_WINDOW_S: the tests' shorter runs)
WINDOW_S = float(os.environ.get("FTB_PACE_WINDOW_S") or 300.0)
MIN_CHUNKS = 5  # ... and at least this many chunks (a run logging every few minutes)
WARMUP_CHUNKS = 2
KEEP = 2000  # chunks the pace before is the median of (at 10 s a chunk, the last 5.5 hours)
SLOW = 0.7
BACK = 0.85


def chunk_seconds(window_s: float) -> float:
    """A chunk's least length: a 30th of the window, never under 5 s (the trainer's clock counts
    whole seconds: 5 s is within 20% of itself)."""
    return max(5.0, window_s / 30)


@dataclass
class Slowdown:
    """One slowdown: the step it was found at, its slowest pace (over a window) against the pace
    before it, and the step it was back at."""

    step: int | None
    rate: float
    before: float
    unit: str
    back_step: int | None = None  # None: slow to the run's end
    back_rate: float | None = None

    @property
    def ratio(self) -> float:
        return self.rate / self.before

    def record(self) -> dict:
        return {**asdict(self), "rate": round(self.rate, 3), "before": round(self.before, 3),
                "ratio": round(self.ratio, 3), "back_rate": None if self.back_rate is None else round(self.back_rate, 3)}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _rate(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


class Pace:
    """Fed the trainer's records (:meth:`feed`); :meth:`judge` says what changed, once."""

    def __init__(self, window_s: float | None = None):
        window_s = WINDOW_S if window_s is None else window_s
        self.window_s = window_s
        self.chunk_s = chunk_seconds(window_s)
        self.unit: str | None = None  # "tok/s" (the trainer counts tokens) or "steps/s"
        self.chunks: deque[tuple[float, float, float]] = deque(maxlen=KEEP + WARMUP_CHUNKS)  # (begin, end, rate)
        self._open: tuple[float, float] | None = None  # (elapsed, count) where the chunk being cut began
        self._skip = WARMUP_CHUNKS  # chunks still to leave out: a trainer's first ones (and a resumed one's)
        self._said: deque[tuple[str, bool]] = deque()  # judged as each chunk closed, not yet taken: (text, slowed)
        self._offset = 0.0  # added to the trainer's clock: a resumed trainer's starts again at 0
        self._last = 0.0  # the latest record's time, the offset added
        self.step: int | None = None
        self.slowdowns: list[Slowdown] = []

    def feed(self, elapsed_s: float | None, tokens: int | None, step: int | None) -> None:
        """A trainer record: its elapsed seconds, its token count (None: it counts none) and step."""
        unit = "tok/s" if tokens is not None else "steps/s"
        count = tokens if tokens is not None else step
        if elapsed_s is None or count is None:
            return
        self.step = step
        if self.unit != unit or self._open is None or elapsed_s < self._open[0] or count < self._open[1]:
            if self.unit != unit:  # (a count of another kind: start again)
                self.chunks.clear()
            # a new clock (a resumed trainer's): its times go on from the last one's, so that the
            # window is still the last window_s of training; its first chunks warm up again
            self._offset = self._last - elapsed_s
            self._skip = WARMUP_CHUNKS
            self.unit, self._open = unit, (elapsed_s, count)
            return
        self._last = elapsed_s + self._offset
        began, counted = self._open
        if elapsed_s - began >= self.chunk_s:
            if self._skip:
                self._skip -= 1
            else:
                self.chunks.append((began + self._offset, self._last, (count - counted) / (elapsed_s - began)))
            self._open = (elapsed_s, count)
            # judged as each chunk closes: the launcher takes what was said once a tick, `status`
            # after every record; both say the same, at the same step
            said = self._judge()
            if said is not None:
                self._said.append((said, self.slowed is not None))

    def _split(self) -> tuple[list[float], list[float]] | None:
        """(the chunks before, the recent ones), or None while there are too few to judge."""
        if not self.chunks:
            return None
        end = self.chunks[-1][1]
        recent = sum(1 for _, at, _ in self.chunks if at > end - self.window_s)
        recent = max(recent, MIN_CHUNKS)
        if len(self.chunks) < 2 * recent:
            return None
        rates = [rate for _, _, rate in self.chunks]
        return rates[:-recent], rates[-recent:]

    @property
    def slowed(self) -> Slowdown | None:
        return self.slowdowns[-1] if self.slowdowns and self.slowdowns[-1].back_step is None else None

    def take(self) -> tuple[str, bool] | None:
        """The next thing to say and whether the run was slow when it was judged; None mostly."""
        return self._said.popleft() if self._said else None

    def _judge(self) -> str | None:
        """A chunk just closed: whether the run slowed, or is back (each judged once per chunk)."""
        split = self._split()
        if split is None:
            return None
        before, recent = split
        now = _median(recent)
        episode = self.slowed
        if episode is None:
            pace = _median(before)
            if pace > 0 and now < SLOW * pace:
                episode = Slowdown(self.step, now, pace, self.unit or "")
                self.slowdowns.append(episode)
                return (f"the run slowed to {now / pace:.2f}x its pace: {_rate(now, episode.unit)} over its last "
                        f"{self._span(len(recent))} (step {episode.step}) against {_rate(pace, episode.unit)} before")
            return None
        episode.rate = min(episode.rate, now)  # (the record keeps its slowest pace)
        if now >= BACK * episode.before:
            episode.back_step, episode.back_rate = self.step, now
            return (f"the run is back to its pace: {_rate(now, episode.unit)} over its last {self._span(len(recent))} "
                    f"(step {episode.back_step}; {_rate(episode.before, episode.unit)} before it slowed at step {episode.step})")
        return None

    def now(self) -> str | None:
        """The pace now against the pace before, in a line (None while too few chunks)."""
        split = self._split()
        if split is None:
            return None
        before, recent = split
        # (while slow: against the pace before it slowed, as the slowdown itself is judged)
        now, pace = _median(recent), self.slowed.before if self.slowed else _median(before)
        return (f"{_rate(now, self.unit or '')} over its last {self._span(len(recent))} (step {self.step}), "
                f"{now / pace:.2f}x its {_rate(pace, self.unit or '')} before" if pace > 0 else None)

    def _span(self, chunks: int) -> str:
        seconds = self.chunks[-1][1] - self.chunks[-chunks][0]
        return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"

    def record(self) -> list[dict]:
        """summary.json's ``slowdowns``."""
        return [s.record() for s in self.slowdowns]


def recorded(value: object) -> list[dict]:
    """summary.json's ``slowdowns`` as :meth:`Pace.record` wrote them; anything else left out."""
    def whole(s):
        return (isinstance(s, dict) and isinstance(s.get("unit"), str)
                and all(isinstance(s.get(k), (int, float)) for k in ("ratio", "rate", "before")))
    return [s for s in value if whole(s)] if isinstance(value, list) else []


def said(s: dict, going: bool = False) -> str:
    """One slowdown (from :meth:`Pace.record`) in a line: the summary's and `ftbundle runs`'
    (``going``: `status`'s, of a run that may still go: "still slow")."""
    back = (f"back at step {s['back_step']}" if s.get("back_step") is not None
            else "still slow" if going else "slow to the end")
    return (f"to {s['ratio']:.2f}x at step {s['step']} ({_rate(s['rate'], s['unit'])} against "
            f"{_rate(s['before'], s['unit'])}), {back}")


def summary_lines(slowdowns: list[dict]) -> list[str]:
    """The closing summary's line for each slowdown."""
    return [f"  slowed       {said(s)}" for s in slowdowns]


def status_lines(trainer_log: str) -> list[str]:
    """`ftbundle status`'s lines on the run's pace, from its trainer log's text (its last records:
    a detached run has no launcher to say it, and another terminal none either)."""
    pace = Pace()
    for line in trainer_log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "current_steps" in record:
            tokens = record.get("total_tokens")
            step = record.get("current_steps")
            pace.feed(trainer_seconds(record.get("elapsed_time")), tokens if isinstance(tokens, int) else None,
                      step if isinstance(step, int) else None)  # (judged as each chunk closes)
    now = pace.now()
    return ([f"pace: {now}"] if now else []) + [f"  slowed {said(s, going=True)}" for s in pace.record()]


def last_step(trainer_log: str) -> int | None:
    """The step of the trainer log's last record (its text's last lines), None when it has none."""
    for line in reversed(trainer_log.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("current_steps"), int):
            return record["current_steps"]
    return None
