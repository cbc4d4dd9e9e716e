"""The closing summary and the failure summary, as text. Pure: values in, lines out.

The failure summary leads with the failing rank's own Python traceback, taken from torch
elastic's error file (``TORCHELASTIC_ERROR_FILE``, written by ``@record`` in the entry
shim) or, for a script without ``@record``, from that rank's own stderr file (torchrun's
``--log-dir`` in the run directory), never torchrun's ChildFailedError wrapper.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from . import pace, stragglers
from .. import gpu_metrics
from ..speed import tokens_text
from .progress import Progress, clock, startup_text


@dataclass(frozen=True)
class RankError:
    """One rank's own failure, from its torch elastic error file."""

    local_rank: int | None
    rank: int | None  # the global rank, when the file says
    message: str
    traceback: str
    timestamp: int


def parse_error_file(text: str, local_rank: int | None = None) -> RankError | None:
    """torch elastic's error.json: {"message": {"message": ..., "extraInfo": {"py_callstack":
    ..., "timestamp": ...}}}; None when it is not one."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if not isinstance(msg, dict):
        return None
    extra = msg.get("extraInfo") or {}
    try:
        timestamp = int(extra.get("timestamp") or 0)
    except (TypeError, ValueError):
        timestamp = 0
    return RankError(local_rank, None, str(msg.get("message", "")), str(extra.get("py_callstack", "")), timestamp)


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")  # torch's per-rank prefixes


def traceback_from_stderr(text: str) -> str | None:
    """The last Python traceback in a rank's stderr, or None. torchrun's own traceback (its
    agent's ChildFailedError, printed in the node log after any rank failed) is not a rank's
    and is skipped."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    for start in reversed(starts):
        out = [lines[start]]
        for line in lines[start + 1:]:
            out.append(line)
            if line and not line[0].isspace():  # the exception line ends the traceback
                break
        if "ChildFailedError" not in out[-1]:
            return "\n".join(out)
    return None


LAST_WORDS = 8
_AGENT_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ torch/distributed/")  # torchrun's own log


def before_torchrun_report(lines: list[str]) -> list[str] | None:
    """A node log's lines up to torchrun's failure report (its ChildFailedError traceback),
    without torchrun's own log lines: what the node's local rank 0 said last. None: no
    report there (not a torchrun failure)."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    ends = [i for i, line in enumerate(lines) if "ChildFailedError" in line]
    if not ends:
        return None
    start = max((i for i in range(ends[0]) if lines[i].startswith("Traceback (most recent call last):")),
                default=ends[0])
    return [line for line in lines[:start] if not _AGENT_LINE.match(line)]


def last_words(text: str, n: int = LAST_WORDS) -> list[str]:
    """The last lines a rank wrote to its stderr, for a rank that died without a Python
    traceback (a signal, std::terminate, a fatal error): faulthandler's one-line list of
    extension modules is left out."""
    lines = [line.rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip() and not line.startswith("Extension modules:")]
    return lines[-n:]


SIGNALS = {9: "SIGKILL", 15: "SIGTERM", 2: "SIGINT", 6: "SIGABRT", 11: "SIGSEGV", 7: "SIGBUS"}


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        return f"killed by {SIGNALS.get(-code, f'signal {-code}')}"
    if code > 128 and code - 128 in SIGNALS:
        return f"exit code {code} ({SIGNALS[code - 128]})"
    return f"exit code {code}"


DISK_FULL = "the disk is full (ENOSPC) where the rank or ftbundle writes"
NO_SPACE_AT = re.compile(r"No space left on device: '([^']+)'")  # Python's OSError names the file
_HINTS = (
    (re.compile(r"No space left on device|ENOSPC|Errno 28\b", re.I),
     DISK_FULL + ": free space under the shared directory (logs, checkpoints) or the output_dir; a rank's log "
     "may be cut"),
    (re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I),
     "out of memory: lower per_device_train_batch_size or cutoff_len, or use gradient checkpointing / ZeRO"),
    # (whole words: an environment line such as "GLOO_SOCKET_IFNAME=eth0 NCCL_TIMEOUT=" is no timeout)
    (re.compile(r"\b(nccl|gloo|ProcessGroup\w*|collective)\b.*\b(timeout|timed out)\b|"
                r"\b(timeout|timed out)\b.*\b(nccl|gloo)\b|Watchdog caught collective operation timeout", re.I),
     "a collective timed out: a peer stopped or is unreachable; check the network interface "
     "(NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME) and `ftbundle check --net`"),
    (re.compile(r"terminate called without an active exception", re.I),
     "the rank aborted in native code (std::terminate). If its program had already returned (at interpreter "
     "exit, after \"Training completed\"), its outputs are saved: torch's teardown at exit can abort a "
     "finished rank; a script avoids it with torch.distributed.destroy_process_group(), flushing, and "
     "os._exit(0) at its end (ftbundle's LlamaFactory entry does this)"),
    (re.compile(r"CUDA error: (uncorrectable ECC error|unspecified launch failure|an illegal memory access|"
                r"misaligned address|unknown error)|cudaErrorECCUncorrectable|CUDA-capable device.*(lost|fallen)",
                re.I),
     "a CUDA error that a GPU fault can cause as well as a bug: an Xid in that host's kernel log (listed "
     "below when one was logged during the run) says the GPU itself failed"),
    (re.compile(r"Address already in use|EADDRINUSE|errno 98", re.I),
     "the master port is in use on rank 0: another run still holds it; pick another master_port "
     "or stop the old run (ftbundle stop)"),
    (re.compile(r"(dataset|dataset_info).*(not found|no such file|cannot find|does not exist)|"
                r"FileNotFoundError.*(data|json|jsonl|parquet|csv)", re.I),
     "a dataset file is missing on that host: it must be at the same path on every host "
     "(shared storage, or `ftbundle check` shows which host lacks it)"),
)


def hint(code: int | None, text: str) -> str | None:
    """A likely cause for a failure, from its exit code and what the rank said."""
    if code in (137, -9):
        return ("killed with SIGKILL (exit 137): most often the kernel's OOM killer; see `dmesg` on that "
                "host, lower the batch size, or give the host more memory")
    for pattern, why in _HINTS:
        if pattern.search(text or ""):
            return why
    return None


def closing_summary(*, run_id: str, run_dir: str, duration_s: float, progress: Progress,
                    output_dir: str | None, adapter: str | None, nnodes: int, staged=(),
                    gpus: dict | None = None) -> list[str]:
    """The lines shown when every node finished; ``staged``: what `stage:` did before it
    (Staged.record of ftbundle/stage.py), a line each; ``gpus``: the GPUs' figures over every
    attempt (gpu_metrics.over_attempts; else this attempt's)."""
    lines = [f"finished run {run_id} on {nnodes} node(s) in {clock(duration_s)}"]
    if progress.start_step:
        lines.append(f"  resumed at   step {progress.start_step} ({progress.steps_done} step(s) this run)")
    if progress.step is not None:
        lines.append(f"  steps        {progress.shown_step}" + (f"/{progress.total}" if progress.total else ""))
    if progress.loss is not None:
        lines.append(f"  final loss   {progress.loss:.4f}")
    elif progress.final_loss is not None:
        # (a run shorter than logging_steps logs no loss: the trainer's own mean is all there is)
        lines.append(f"  final loss   {progress.final_loss:.4f} (train_loss, the mean over the run: no step logged)")
    for s in staged:  # (its time came before the launch: not in the start-up's parts)
        lines.append(f"  staged       {str(s.get('said', '')).removeprefix('staged ')}")
    if progress.first_step_at is not None and (parts := progress.startup()):
        lines.append(f"  before step  {startup_text(parts)}")
    rate = progress.throughput()
    if rate:
        trainer = progress.samples_per_s
        differs = trainer is not None and abs(trainer - rate) >= 0.05
        lines.append(f"  throughput   {rate:.1f} samples/s" + (
            f" (over the {progress.steps_done} step(s) this attempt made; the trainer's own "
            f"train_samples_per_second {trainer:.2f}, in the logs, counts all {progress.total} of its schedule "
            "over this attempt's time)" if differs and progress.total else ""))
    elif progress.steps_per_s():
        lines.append(f"  throughput   {progress.steps_per_s():.2f} steps/s")
    if (tokens := progress.tokens_per_s()) is not None and progress.speed is not None:
        lines.append(f"  tokens       {tokens_text(tokens, progress.speed)}")
        mfu = progress.mfu()
        if progress.speed.gpus:
            lines.append("  MFU          " + (f"{mfu:.1%}: {progress.speed.mfu_basis()}" if mfu is not None
                                               else progress.speed.mfu_basis()))
    lines += pace.summary_lines(progress.pace.record())
    lines += stragglers.summary_lines(progress.node_steps.values(), progress.straggler_factor)
    lines += gpu_metrics.summary_lines(gpus if gpus is not None else progress.gpus.record())
    if progress.diverged:  # (divergence: warn: said once while it went; its result is not to be trusted)
        lines.append(f"  diverged     {progress.diverged} (divergence: warn: the run went on)")
    if output_dir:
        lines.append(f"  output dir   {output_dir}")
    if adapter:
        lines.append(f"  adapter      {adapter}")
    lines.append(f"  run dir      {run_dir}")
    return lines


TRACEBACK_LINES = 30


def _indented(traceback: str) -> list[str]:
    """The end of a traceback (where the error is), indented; a cut is marked."""
    lines = traceback.rstrip().splitlines()
    cut = ["  ..."] if len(lines) > TRACEBACK_LINES else []
    return cut + ["  " + line for line in lines[-TRACEBACK_LINES:]]


DIVERGED = "TrainingDiverged: "  # (shims/steptimes.py: what every rank raises when its loss went nan)


def raised_verdict(error: RankError | None, traceback: str | None) -> str | None:
    """What the ranks said when they stopped a run whose loss went nan or whose model collapsed
    (the exception's own text), from the failing rank's error file or traceback; else None."""
    for text in (error.message if error else None, error.traceback if error else None, traceback):
        for line in reversed((text or "").splitlines()):
            if DIVERGED in line:
                return line.split(DIVERGED, 1)[1].strip()
    return None


def failure_summary(*, host: str, address: str, node_rank: int, reason: str, code: int | None,
                    rank_error: RankError | None, rank_traceback: str | None, tail: list[str] | None,
                    log_path: str, local_rank: int | None = None, global_rank: int | None = None,
                    rank_last_words: tuple[str | None, list[str]] | None = None,
                    wrapper_said: tuple[str, ...] = ()) -> list[str]:
    """The lines shown when a run failed, after the "failed first" line: which rank, its
    own traceback (else its last lines on stderr, else the end of its node's log), a hint,
    where the full log is. ``rank_last_words``: (its stderr file, or None for the node log;
    its last lines). ``wrapper_said``: the node program's own messages (a full disk), read
    for the hint."""
    who = [f"host {host} ({address})", f"node rank {node_rank}"]
    if global_rank is not None:
        who.append(f"rank {global_rank}")
    if local_rank is not None:
        who.append(f"local rank {local_rank}")
    lines = ["failed: " + ", ".join(who) + f"; {describe_exit(code)}"]
    text = reason
    if said := raised_verdict(rank_error, rank_traceback):  # (its traceback is the trainer's: nothing to read in it)
        lines.append(f"its ranks stopped the run (divergence: stop, every rank at the same logged step): {said}")
        lines.append(f"full log: {log_path}")
        return lines
    if rank_error is not None and rank_error.traceback:
        lines.append("its own traceback (torch elastic error file):")
        lines += _indented(rank_error.traceback)
        text += "\n" + rank_error.traceback + "\n" + rank_error.message
    elif rank_traceback:
        lines.append("its own traceback:")
        lines += _indented(rank_traceback)
        text += "\n" + rank_traceback
    elif rank_last_words and rank_last_words[1]:
        path, words = rank_last_words
        lines.append(f"its last {len(words)} line(s) on stderr ({path}):" if path else
                     f"its last {len(words)} line(s) before torchrun's report, in {log_path}:")
        lines += ["  | " + line for line in words]
        text += "\n" + "\n".join(words)
    elif tail:
        lines.append(f"last {len(tail)} lines of {log_path}:")
        lines += ["  | " + line for line in tail]
    text += "\n" + "\n".join(tail or []) + "\n" + "\n".join(wrapper_said)
    why = hint(code, text)
    if why and why.startswith(DISK_FULL) and (where := NO_SPACE_AT.search(text)):
        why = f"no space left on the disk of {where.group(1)} on {host} (ENOSPC): " + why[len(DISK_FULL):].lstrip(": ")
    if why:
        lines.append(f"hint: {why}")
    lines.append(f"full log: {log_path}")
    return lines
