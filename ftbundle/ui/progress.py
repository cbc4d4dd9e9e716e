"""Training progress from what the ranks write, folded into one value. Pure: no I/O.

Three sources, best first:

* LlamaFactory's ``trainer_log.jsonl`` (its LogCallback, one JSON object per logging step:
  current_steps, total_steps, loss, lr, epoch, percentage, elapsed_time, remaining_time);
* the HF Trainer's log dicts on rank 0's stdout (``{'loss': 1.2, 'learning_rate': ...}``);
* a tqdm bar's ``12/60`` (steps) when nothing better says where training is.
"""

from __future__ import annotations

import ast
import json
import re
import time
from dataclasses import dataclass, field

from ..gpu_metrics import GpuFleet
from ..protocol import parse_steps
from ..speed import SpeedBasis, script_params, tokens_text
from . import stragglers
from .pace import Pace, trainer_seconds

STRAGGLERS_EVERY_S = 1.0  # the fleet's step times are judged again at most this often (feed_steps)
# the Trainer's own bar has no description ("35%|###5   | 21/60 [00:03<...]"); a dataset's
# ("Running tokenizer on dataset: 100%|...| 21/21") says nothing about training steps
_BAR = re.compile(r"^\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")
_DICT = re.compile(r"\{'(?:loss|train_runtime|eval_loss)'.*\}")
# the trainer's closing metrics table ("  train_loss               =     6.2293")
_CLOSING = re.compile(r"\b(train_samples_per_second|train_loss)\s*=\s*([\d.]+)")


# What the ranks are doing before the first step, from LlamaFactory's and transformers' own
# log lines on rank 0 (first match wins; in the order they come: LlamaFactory loads the
# tokenizer, the dataset, then the model). A stage is a fixed phrase, never the raw line.
# Each pattern comes with the plain substrings one of which every line it matches holds: a
# chatty rank 0 prints millions of lines, and a substring test costs a tenth of a regex search.
_STAGES = (
    # ftbundle's LlamaFactory entry (shims/llamafactory_entry.py), once its imports are done
    (("ftbundle: imported ",), re.compile(r"ftbundle: imported "), "starting LlamaFactory"),
    (("Running training",), re.compile(r"\*\*\*\*\* Running training \*\*\*\*\*"), "starting the first step"),
    (("Fine-tuning method: ",), re.compile(r"Fine-tuning method: (\w+)"), "preparing the model ({0})"),
    (("oading weights", "Loading checkpoint shards", "Instantiating "),
     re.compile(r"loading weights file|Loading weights|Loading checkpoint shards|Instantiating \w+ model"),
     "loading model"),
    (("Running tokenizer on dataset",), re.compile(r"Running tokenizer on dataset"), "tokenizing dataset"),
    # LlamaFactory given a kept tokenized_path (ftbundle/tokenized.py): "Loading dataset from disk will ..."
    (("Loading dataset from disk", "Loaded tokenized dataset"),
     re.compile(r"Loading dataset from disk|Loaded tokenized dataset"), "tokenizing dataset: reused"),
    (("Loading dataset ", "Generating train split", "Converting format of dataset"),
     re.compile(r"Loading dataset |Generating train split|Converting format of dataset"), "loading dataset"),
    (("Process rank: ",), re.compile(r"Process rank: \d+, world size: (\d+)"), "loading tokenizer ({0} ranks connected)"),
    # LlamaFactory parsed its arguments: next it joins the process group, which waits for every rank
    (("llamafactory.hparams.parser",), re.compile(r"llamafactory\.hparams\.parser"), "waiting for ranks"),
)
_STAGE_WORDS = tuple(word for words, _, _ in _STAGES for word in words)


def _may_tell_stage(line: str) -> bool:
    """False for a line no stage pattern can match (most lines): no regex is run on it."""
    for word in _STAGE_WORDS:
        if word in line:
            return True
    return False


# The plain words the trainer-output parsers need in a line (feed_line and may_tell test the same)
CLOSING_MARK = "train_"  # the closing metrics table
# rank 0's word that its run diverged and goes on (shims/steptimes.py ``diverged``, divergence: warn:
# "ftbundle: warning: SAID (divergence: warn: the run goes on)"; the shim cannot import this)
DIVERGED_MARK = " (divergence: warn: the run goes on)"
DIVERGED_HEAD = "ftbundle: warning: "
DICT_MARK = "{'"  # a log dict
BAR_MARK = "%|"  # a tqdm bar


def stage_of(line: str) -> str | None:
    """The stage a line of rank 0's output tells of before training, or None."""
    if not _may_tell_stage(line):
        return None
    for _, pattern, text in _STAGES:
        match = pattern.search(line)
        if match:
            return text.format(*match.groups())
    return None


IMPORTED = re.compile(r"ftbundle: imported .* in ([\d.]+) ?s\b")  # the entry's own import time
LAUNCH_PART = "launch and start-up"  # before the first stage line: nodes up, torchrun, Python starting
IMPORT_PART = "imports (torch, transformers, LlamaFactory)"


def stage_name(stage: str) -> str:
    """A stage as a part of the start-up: "loading tokenizer (6 ranks connected)" -> "loading tokenizer"."""
    return stage.split(" (", 1)[0]


def startup_parts(started: float, stages: list[tuple[str, float]], end: float,
                  import_s: float | None = None) -> list[tuple[str, float]]:
    """Where the time before the first step went: (part, seconds) in the order they came, a stage
    seen twice counted once with both times; the entry's own import time split off the part
    its line ended. Pure."""
    if not stages:
        return []
    parts: dict[str, float] = {LAUNCH_PART: max(0.0, stages[0][1] - started)}
    for (stage, at), (_, until) in zip(stages, [*stages[1:], ("", end)]):
        name = stage_name(stage)
        if name == "starting LlamaFactory" and import_s is not None:
            before = list(parts)[-1]  # (the part its line ended: it held the import)
            parts[before] = max(0.0, parts[before] - import_s)
            parts[IMPORT_PART] = parts.get(IMPORT_PART, 0.0) + import_s
        parts[name] = parts.get(name, 0.0) + max(0.0, until - at)
    return [(name, seconds) for name, seconds in parts.items() if name != "starting the first step" or seconds]


def startup_text(parts: list[tuple[str, float]]) -> str:
    """"32.1 s: imports (torch, ...) 21.8 s, loading model 2.1 s, ..." """
    total = sum(seconds for _, seconds in parts)
    return f"{total:.1f} s: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts)


def parse_trainer_log(line: str) -> dict | None:
    """One trainer_log.jsonl record, or None when the line is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "current_steps" in record else None


def parse_hf_dict(line: str) -> dict | None:
    """The HF Trainer's printed log dict within a line, or None."""
    match = _DICT.search(line)
    if not match:
        return None
    try:
        value = ast.literal_eval(match.group(0))
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, dict) else None


def parse_bar(line: str) -> tuple[int, int] | None:
    """(step, total) from a tqdm bar such as ``12/60 [00:03<00:10, 3.9it/s]``."""
    match = _BAR.search(line)
    if not match:
        return None
    step, total = int(match.group(1)), int(match.group(2))
    return (step, total) if 0 <= step <= total else None


RECORDS_MAX = 20_000  # the trainer's records a run keeps for its plot (Progress.keep_record)


@dataclass
class Progress:
    """Where training is. ``feed_*`` fold one observation in; the rest is read-only."""

    started: float = field(default_factory=time.monotonic)  # when the training phase began
    step: int | None = None
    total: int | None = None
    epoch: float | None = None
    loss: float | None = None  # the latest
    lr: float | None = None
    elapsed_s: float | None = None  # as the trainer counts it
    remaining_s: float | None = None
    samples_per_s: float | None = None  # the trainer's own, from its closing report (see throughput)
    train_loss: float | None = None  # the trainer's closing train_loss: the mean over all its steps
    effective_batch: int | None = None  # samples per optimizer step, when known
    # trainer_log.jsonl-shaped, for plots and metrics.jsonl: at most RECORDS_MAX, thinned by halves
    # (keep_record; every record stays in the trainer's own log), the latest apart (plot_records)
    records: list[dict] = field(default_factory=list)
    last_line: str = ""
    from_jsonl: bool = False  # trainer_log.jsonl seen, or expected (LlamaFactory): it wins over stdout
    stage: str | None = None  # before the first step: what the ranks are doing (stage_of)
    stages: list[tuple[str, float]] = field(default_factory=list)  # (stage, monotonic time it began)
    import_s: float | None = None  # the LlamaFactory entry's own import time, as it said
    first_step_at: float | None = None  # (monotonic) when the first step was seen: the start-up's end
    # the step this attempt resumed from (a checkpoint's global_step): rates count from here,
    # as the trainer's own numbers do not (its samples/s counts every step since 0)
    start_step: int = 0
    # without the trainer's clock (stdout only): (monotonic time, step) when a step was first seen
    first_step: tuple[float, int] | None = None
    # every node's step times, as its node program forwards them (ui.stragglers), by host
    node_steps: dict[str, stragglers.NodeSteps] = field(default_factory=dict)
    straggler_factor: float = stragglers.STRAGGLER_FACTOR
    # tokens (the trainer's count: ftbundle.speed): the latest total, and (trainer's elapsed s, total)
    # at this attempt's first record: a resumed trainer's total counts the steps before it too
    tokens: int | None = None
    tokens_first: tuple[float, int] | None = None
    tokens_rate: float | None = None  # the trainer log's own tokens/s (LlamaFactory's "throughput")
    speed: SpeedBasis | None = None  # ranks, GPUs' peak, parameters: per rank and MFU (ftbundle.speed)
    # a script's ranks' own token counts, (host, local rank) -> (tokens, seconds of its clock)
    rank_tokens: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    rank_params: dict[tuple[str, int], int] = field(default_factory=dict)  # a script's model, as each rank counted it
    # every node's GPU readings while the run goes (ftbundle.gpu_metrics: the live line's GPU field)
    gpus: GpuFleet = field(default_factory=GpuFleet)
    # the run's recent pace against its own (ui.pace): a slowdown of the whole fleet, said while it goes
    pace: Pace = field(default_factory=Pace)
    # parts of the start-up that came before the launch: ("staging data", seconds) (ftbundle.stage)
    before: tuple[tuple[str, float], ...] = ()
    diverged: str | None = None  # rank 0's word that the loss went nan or the model collapsed (divergence: warn)
    _slowest: str | None = None  # the live line's straggler, as last judged (feed_steps)
    _seen: int = 0  # records offered to keep_record, and every how many one is kept
    _stride: int = 1
    _latest: dict | None = None
    _judged_at: float | None = None

    def _loss(self, value) -> None:
        if isinstance(value, (int, float)):
            self.loss = float(value)

    def feed_record(self, record: dict) -> None:
        """A trainer_log.jsonl record."""
        if not self.from_jsonl:
            self.records.clear()  # what stdout said before the first record: this says it better
            self._seen, self._stride, self._latest = 0, 1, None
        self.from_jsonl = True
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        self.step = int(record.get("current_steps") or 0)
        self.total = int(record.get("total_steps") or 0) or self.total
        if "loss" in record:
            self._loss(record["loss"])
        if record.get("lr") is not None:
            self.lr = float(record["lr"])
        if record.get("epoch") is not None:
            self.epoch = float(record["epoch"])
        self.elapsed_s = trainer_seconds(record.get("elapsed_time")) or self.elapsed_s
        self.remaining_s = trainer_seconds(record.get("remaining_time"))
        if isinstance(record.get("total_tokens"), int):
            self.tokens = record["total_tokens"]
            if self.tokens_first is None and self.elapsed_s is not None:
                self.tokens_first = (self.elapsed_s, self.tokens)
            rate = record.get("throughput")  # (LlamaFactory's: the count over its own clock, to the ms)
            self.tokens_rate = float(rate) if isinstance(rate, (int, float)) and rate > 0 else None
        tokens = record.get("total_tokens")
        self.pace.feed(trainer_seconds(record.get("elapsed_time")), tokens if isinstance(tokens, int) else None, self.step)
        if "loss" in record:  # the last record (the trainer's end) has none: nothing to plot
            self.keep_record({k: record.get(k) for k in ("current_steps", "total_steps", "loss", "lr", "epoch")})

    def keep_record(self, record: dict) -> None:
        """One record for the plot: every one up to RECORDS_MAX, then every other one of those
        and every second one from then on, and so on (evenly spaced: a week at one record a
        second is 600,000 records, about 180 MB held and sent at the end, as 20,000 it is 6 MB)."""
        self._latest = record
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        self.records.append(record)
        if len(self.records) > RECORDS_MAX:
            self.records = self.records[::2]
            self._stride *= 2

    def plot_records(self) -> list[dict]:
        """The records kept, and the latest one whether kept or not (the curve ends where the run did)."""
        if self._latest is not None and (not self.records or self.records[-1] is not self._latest):
            return [*self.records, self._latest]
        return list(self.records)

    def gpu_tick(self, now: float, first_step: float | None) -> list[str]:
        """The GPUs' look (ftbundle.gpu_metrics): what is to be named now, an idle node said
        input-bound or waiting from its step times."""
        return self.gpus.tick(now, step=self.shown_step, first_step=first_step, cause=lambda host: stragglers.idle_cause(
            host, self.node_steps, self.straggler_factor))

    def pace_tick(self) -> tuple[str, bool] | None:
        """(what to say, whether it is a warning) when the run slowed or is back (ui.pace); with the
        node that sets the pace when the step times name one, else that every node slowed alike."""
        taken = self.pace.take()
        if taken is None:
            return None
        said, slow = taken
        if not slow:
            return said, False
        if self._slowest:
            return f"{said}; the slowest node: {self._slowest} the fleet's median step compute", True
        if len(self.node_steps) >= stragglers.MIN_NODES:
            return f"{said}; the step times name no straggler: every node slowed alike (their input, the network, the hosts)", True
        return said, True

    def feed_steps(self, host: str, text: str, now: float | None = None) -> bool:
        """A node's ``ftb-steps`` line; True when it changed what is shown (who is slowest). The
        fleet is judged again at most every STRAGGLERS_EVERY_S: every node says its figure about
        once a second, and at 1,024 nodes a judgement per line would be a sort per millisecond."""
        ranks = parse_steps(text)
        node = stragglers.node_steps(host, ranks)
        if node is None:
            return False
        self.node_steps[host] = node
        for rank in ranks:  # a script's own token count (StepClock.step_done(tokens=N))
            if rank.tokens is not None:
                self.rank_tokens[(host, rank.local_rank)] = (rank.tokens, rank.tokens_s or 0.0)
            if rank.params is not None and self.rank_params.get((host, rank.local_rank)) != rank.params:
                self.rank_params[(host, rank.local_rank)] = rank.params  # (and MFU: its parameters, counted)
                self.speed = script_params(self.speed, self.rank_params)
        now = time.monotonic() if now is None else now
        if self._judged_at is not None and now - self._judged_at < STRAGGLERS_EVERY_S:
            return False
        self._judged_at = now
        before, self._slowest = self._slowest, stragglers.live_field(self.node_steps.values(), self.straggler_factor)
        return self._slowest != before

    def startup(self, now: float | None = None) -> list[tuple[str, float]]:
        """Where the time before the first step went (so far, before it): see startup_parts;
        ``before`` (staging, ahead of the launch) first."""
        parts = startup_parts(self.started, self.stages, self.first_step_at or now or time.monotonic(), self.import_s)
        return [*self.before, *parts] if parts else parts

    @property
    def slowest(self) -> str | None:
        """The live line's "node2 1.4x" (None: nobody is a straggler), as last judged."""
        return self._slowest

    def may_tell(self, text: str) -> bool:
        """False for text (a line, or many lines at once) that :meth:`feed_line` would only
        keep as the last line: it holds none of the parsers' plain markers. The same tests
        as feed_line's, so a block they pass is fed a line at a time, and one they fail costs
        a few substring scans in all, not a few per line."""
        return (CLOSING_MARK in text or DICT_MARK in text or BAR_MARK in text
                or (not self.known and _may_tell_stage(text)))  # (DIVERGED_MARK's line is a warning: may_warn's)

    def quiet_lines(self, lines: list[str]) -> None:
        """Lines that :meth:`may_tell` found nothing in: what feed_line would keep of them,
        the last that is not blank."""
        for line in reversed(lines):
            stripped = line.strip()
            if stripped:
                self.last_line = stripped[-200:]
                return

    def feed_line(self, line: str) -> bool:
        """A line of rank 0's output; True when it told us something about training (or a
        new stage before it). Each parser runs only on a line holding its plain marker: on
        a chatty rank 0 nearly every line is none of these, and is let go after a few
        substring tests."""
        stripped = line.strip()
        if not stripped:
            return False
        self.last_line = stripped[-200:]
        told = False
        if not self.known and (stage := stage_of(stripped)) is not None:
            told, self.stage = stage != self.stage, stage
            if told:
                self.stages.append((stage, time.monotonic()))
                if self.import_s is None and (imported := IMPORTED.search(stripped)):
                    self.import_s = float(imported.group(1))
        if self.diverged is None and DIVERGED_MARK in stripped and DIVERGED_HEAD in stripped:
            self.diverged = stripped.split(DIVERGED_HEAD, 1)[1].split(DIVERGED_MARK, 1)[0]
            return True
        closing = _CLOSING.search(line) if CLOSING_MARK in line else None
        if closing:  # the trainer's closing metrics table
            self._closing(closing.group(1), closing.group(2))
            return True
        values = parse_hf_dict(line) if DICT_MARK in line else None
        if values is not None:
            if "train_samples_per_second" in values:  # the trainer's closing log dict
                for name in ("train_samples_per_second", "train_loss"):
                    if name in values:
                        self._closing(name, values[name])
                return True
            if self.from_jsonl:
                return True
            if self.first_step_at is None:
                self.first_step_at = time.monotonic()
            self._loss(values.get("loss"))
            if values.get("learning_rate") is not None:
                self.lr = float(values["learning_rate"])
            if values.get("epoch") is not None:
                self.epoch = float(values["epoch"])
            if "loss" in values:
                self.keep_record({"current_steps": self.step, "total_steps": self.total,
                                  "loss": self.loss, "lr": self.lr, "epoch": self.epoch})
            return True
        bar = parse_bar(line) if BAR_MARK in line else None
        if bar is not None and not self.from_jsonl:
            self.step, self.total = bar
            if self.first_step is None:
                self.first_step = (time.monotonic(), bar[0])
            if self.first_step_at is None:
                self.first_step_at = self.first_step[0]
            return True
        return told

    def _closing(self, name: str, text) -> None:
        """A figure of the trainer's closing report (a number, or its text: transformers 5
        prints its closing log dict's values as strings)."""
        try:
            value = float(text)
        except (TypeError, ValueError):
            return
        if name == "train_loss":
            self.train_loss = value
        else:
            self.samples_per_s = value

    # -- derived -------------------------------------------------------------------------
    def elapsed(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.started

    @property
    def shown_step(self) -> int | None:
        """The step as shown: never past the total (a resumed, finished trainer logs one more)."""
        if self.step is None:
            return None
        return min(self.step, self.total) if self.total else self.step

    @property
    def steps_done(self) -> int:
        """Steps made by this attempt (since the checkpoint it resumed from)."""
        return max(0, (self.shown_step or 0) - self.start_step)

    def steps_per_s(self, now: float | None = None) -> float | None:
        """Steps a second this attempt, by the trainer's clock (trainer_log.jsonl's elapsed
        time: it starts with the first step, not with the model's loading); on stdout
        alone, from the first step seen. None until there is such a clock."""
        if self.elapsed_s:
            steps, seconds = self.steps_done, self.elapsed_s
        elif self.first_step is not None:
            at, step = self.first_step
            steps, seconds = max(0, (self.shown_step or 0) - max(step, self.start_step)), (now or time.monotonic()) - at
        else:
            return None
        return steps / seconds if steps and seconds > 0 else None

    def throughput(self, now: float | None = None) -> float | None:
        """Samples per second over the steps this attempt trained: the one figure the live
        line, the closing summary, summary.json and `ftbundle runs` show.

        Once the trainer has ended, its own train_samples_per_second: every sample of its
        schedule over its train_runtime (which starts with the first step, and is measured
        to the millisecond), scaled to the steps this attempt made (a resumed attempt's
        trainer counts the steps before it too; a stopped one, those it never made). Before
        that, the same from the trainer's clock so far: steps x samples per step (the
        effective batch) over its elapsed time. None when neither is known."""
        if self.samples_per_s is not None:
            if self.total:
                return self.samples_per_s * min(1.0, self.steps_done / self.total) if self.steps_done else None
            return None if self.start_step else self.samples_per_s
        rate = self.steps_per_s(now)
        return rate * self.effective_batch if rate and self.effective_batch else None

    @property
    def tokens_counted(self) -> int | None:
        """The tokens computed so far: the trainer's count, or a script's ranks' counts summed
        (StepClock's; None when neither says)."""
        if self.tokens is None and self.rank_tokens:
            return sum(tokens for tokens, _ in self.rank_tokens.values())
        return self.tokens

    def tokens_per_s(self) -> float | None:
        """Tokens a second by the trainer's clock: its count over its elapsed time on a fresh
        start (as LlamaFactory's own throughput), and from this attempt's first record on a
        resumed one (whose count and clock hold the steps before it differently); for a script
        that counts its own (StepClock), the sum of its ranks' rates."""
        if not self.start_step and self.tokens_rate:
            return self.tokens_rate  # (its elapsed_time is in whole seconds: this is to the ms)
        if self.tokens is None and self.rank_tokens:  # a script's ranks: each one's count over its own clock
            rates = [tokens / seconds for tokens, seconds in self.rank_tokens.values() if seconds > 0]
            return sum(rates) if rates else None
        if self.tokens is None or not self.elapsed_s:
            return None
        if not self.start_step:
            return self.tokens / self.elapsed_s
        if self.tokens_first is None:
            return None
        seconds = self.elapsed_s - self.tokens_first[0]
        return (self.tokens - self.tokens_first[1]) / seconds if seconds > 0 else None

    def mfu(self) -> float | None:
        return self.speed.mfu(self.tokens_per_s()) if self.speed is not None else None

    @property
    def final_loss(self) -> float | None:
        """The last loss logged; in a run shorter than one logging step (none logged), the
        trainer's closing train_loss (the mean over its steps: all there is)."""
        return self.loss if self.loss is not None else self.train_loss

    def eta(self, now: float | None = None) -> float | None:
        if self.remaining_s is not None and not self.start_step:  # LlamaFactory's assumes a start at 0
            return self.remaining_s
        rate = self.steps_per_s(now)
        if rate and self.total and self.step is not None:
            return max(0, self.total - self.step) / rate
        return None

    @property
    def known(self) -> bool:
        return self.step is not None or self.loss is not None


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    if h >= 24:  # (a week-long run: "6d 23:59:59", not "167:59:59")
        d, h = divmod(h, 24)
        return f"{d}d {h:02d}:{m:02d}:{s:02d}"
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def nodes_field(alive: int, total_nodes: int, finished: int = 0) -> str:
    """Nodes running of all; once nodes have finished (exit 0), they are said to have, not
    counted as gone: "2/2 finished", "1/2 (1 finished)"."""
    if finished and not alive:
        return f"{finished}/{total_nodes} finished"
    return f"{alive}/{total_nodes}" + (f" ({finished} finished)" if finished else "")


def status_fields(p: Progress, alive: int, total_nodes: int, now: float | None = None,
                  finished: int = 0) -> list[tuple[str, str]]:
    """(label, value) pairs of the live status, in display order; pure formatting."""
    fields = []
    if p.step is not None and p.total:
        fields.append(("step", f"{p.shown_step}/{p.total}"))
    elif p.step is not None:
        fields.append(("step", str(p.step)))
    if p.epoch is not None:
        fields.append(("epoch", f"{p.epoch:.2f}"))
    if p.loss is not None:  # the last loss logged, as the trainer's log and the summary's final loss say it
        fields.append(("loss", f"{p.loss:.4f}"))
    if p.lr is not None:
        fields.append(("lr", f"{p.lr:.2e}"))
    samples = p.throughput(now)
    if samples is not None:
        fields.append(("samples/s", f"{samples:.1f}"))
    elif (rate := p.steps_per_s(now)) is not None:
        fields.append(("it/s", f"{rate:.2f}"))
    if (tokens := p.tokens_per_s()) is not None:
        fields.append(("tok/s", f"{tokens:,.0f}"))
        if (mfu := p.mfu()) is not None:
            fields.append(("mfu", f"{mfu:.1%}"))
    if (gpus := p.gpus.live()) is not None:
        fields.append(("GPU", gpus))
    fields.append(("elapsed", clock(p.elapsed(now))))
    fields.append(("eta", clock(p.eta(now))))
    fields.append(("nodes", nodes_field(alive, total_nodes, finished)))
    if (slowest := p.slowest) is not None:
        fields.append(("slowest", slowest))
    return fields


def status_line(p: Progress, alive: int, total_nodes: int, now: float | None = None, finished: int = 0) -> str:
    """The plain progress line (no carriage returns, no colour)."""
    return "  ".join(f"{k} {v}" for k, v in status_fields(p, alive, total_nodes, now, finished))


def status_training(trainer_log: str, speed: SpeedBasis | None, age_s: float | None) -> list[str]:
    """`ftbundle status`'s line on where training is, from the trainer log's last records (a
    detached run has no live line; another terminal none either): the live line's step, epoch,
    loss and lr, tokens/s (per GPU, per rank) and MFU as the summary counts them, the trainer's
    clock and its ETA, and how long ago its last record was written."""
    p, elapsed = Progress(speed=speed), None
    for line in trainer_log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("current_steps"), int):
            p.feed_record(record)
            elapsed = trainer_seconds(record.get("elapsed_time"))  # (0 s too: a short run's)
    if p.step is None:
        return []
    fields = [f"{k} {v}" for k, v in status_fields(p, 0, 0) if k in ("step", "epoch", "loss", "lr")]
    if (tokens := p.tokens_per_s()) is not None:
        fields.append(tokens_text(tokens, speed) if speed is not None else f"{tokens:,.0f} tokens/s")
        if (mfu := p.mfu()) is not None:
            fields.append(f"mfu {mfu:.1%}")
    if elapsed is not None:
        fields.append(f"trainer's clock {clock(elapsed)}")
    if p.remaining_s is not None:
        fields.append(f"eta {clock(p.remaining_s)}")
    said = "" if age_s is None else f"  (its last record {max(0, int(age_s))} s ago)" if age_s < 120 else \
        f"  (its last record {clock(age_s)} ago)"
    return ["training: " + "  ".join(fields) + said]
