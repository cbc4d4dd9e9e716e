"""A run's figures from its trainer's own log, where no launcher counted them: the final loss and
tokens/s of a run without summary.json (`ftbundle runs`: history.py) and of a detached run's end
as its watcher judges it (remote/watch.py ``end``: ended.aN and the webhook's summary, as an attached run's).

The trainer log is LlamaFactory's trainer_log.jsonl in output_dir: one JSON record a logging step
(``loss``, ``total_tokens`` and ``throughput`` where the trainer counts its tokens, the trainer's
clock as ``elapsed_time``). Its first line and last ones are all that is read: a week-long run's
log is about 180 MB. Folded as the launcher's closing summary folds the whole log on a fresh start
(ui/progress.py ``Progress.tokens_per_s``, ``final_loss``): the last loss logged; LlamaFactory's own
throughput of the last record that counts tokens (its count over its clock, to the ms), else that
count over the clock. tests/unit/test_trainer_end_unit.py holds the two to the same figures.

Standard library only: shipped in the watcher's text (launch/stall.py ``WATCH_PARTS``).
"""

import json
import os
import re

TAIL_BYTES = 16384  # a log's end read for its last records (a record is a few hundred bytes)

_DAYS = re.compile(r"^\s*(-?\d+) days?, (.*)$")


def trainer_seconds(text):
    """LlamaFactory writes times as Python's timedelta prints them: H:MM:SS, and from a day on
    "1 day, H:MM:SS", "6 days, H:MM:SS" (a week-long run's clock, and a long run's ETA)."""
    if isinstance(text, (int, float)):
        return float(text)
    days, text = 0, str(text)
    m = _DAYS.match(text)
    if m is not None:
        days, text = int(m.group(1)), m.group(2)
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        return None
    total = 0.0
    for part in parts:
        total = total * 60 + part
    return days * 86400 + total


def parse_records(text):
    """The JSON objects of a text's lines (a half-written last line, or any other, skipped)."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def log_mark(path):
    """What a log is now (its inode, size and change time), None when there is none: taken as a run
    starts, a log with the same mark at its end is an earlier run's in the same output_dir (a job
    that failed before its trainer began), whatever the clocks of the host and the storage say."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def read_ends(path, unless=None):
    """The records of a trainer log's first line and last ones, read without reading it whole;
    [] when it cannot be read, or its mark is still ``unless`` (log_mark's, at the run's start)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if unless is not None and (st.st_ino, st.st_size, st.st_mtime_ns) == tuple(unless):
                return []
            first = f.readline()
            f.seek(max(f.tell(), st.st_size - TAIL_BYTES))
            last = f.read().splitlines()[-3:]
    except OSError:
        return []
    return parse_records(b"\n".join([first.rstrip(b"\n")] + last).decode("utf-8", "replace"))


EARLIER_SLACK_S = 10  # a log last written this long before its run's plan.json is an earlier run's (clocks apart)


def earlier_run(log_mtime, plan_mtime):
    """Whether a trainer log last changed before its run began (its plan.json, written before any
    node starts) is an earlier run's left in output_dir: a fresh trainer removes it as it begins, a
    resuming one appends; until then this run has logged nothing there (`status`, `runs`, `plot`)."""
    return log_mtime < plan_mtime - EARLIER_SLACK_S


def ends_figures(records):
    """{"final_loss", "tokens_per_s"} of a fresh start's records, first to last (None: not known)."""
    loss = tokens = rate = elapsed = None
    for record in records:
        if isinstance(record.get("loss"), (int, float)):
            loss = float(record["loss"])
        elapsed = trainer_seconds(record.get("elapsed_time")) or elapsed
        if isinstance(record.get("total_tokens"), int):
            tokens = record["total_tokens"]
            given = record.get("throughput")
            rate = float(given) if isinstance(given, (int, float)) and given > 0 else None
    tokens_per_s = rate if rate else (tokens / elapsed if tokens is not None and elapsed else None)
    return {"final_loss": loss, "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1)}


def speed_figures(tokens_per_s, ranks, mfu_per_token_s):
    """{"tokens_per_s_per_rank", "mfu"} from the run's speed basis as plan.json keeps it (ftbundle.speed
    ``SpeedBasis``): its ranks, and its MFU per token a second (0 or None: MFU not known)."""
    if tokens_per_s is None:
        return {"tokens_per_s_per_rank": None, "mfu": None}
    return {"tokens_per_s_per_rank": round(tokens_per_s / ranks, 1) if ranks else None,
            "mfu": float(f"{tokens_per_s * mfu_per_token_s:.4g}") if mfu_per_token_s else None}


def told_figures(records, speed, hosts):
    """A told end's hosts, loss, tokens/s (per rank) and MFU (a detached run's watcher, watch.py; an
    attached run's rank 0 whose launcher was lost, tell.py): from its trainer log's ``records``
    (read_ends), against FTB_SPEED's "RANKS MFU_PER_TOKEN_S" (``speed``), FTB_NODE_HOSTS (``hosts``)."""
    found = ends_figures(records)
    ranks, _, per_token_s = (speed or "").partition(" ")
    try:
        speeds = speed_figures(found["tokens_per_s"], int(ranks or 0), float(per_token_s or 0))
    except ValueError:
        speeds = speed_figures(None, 0, 0)
    return {"hosts": (hosts or "").split(), **found, **speeds}
