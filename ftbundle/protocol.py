"""The node channel's words: what the launcher writes on a node program's stdin and what the
node program (ftbundle/remote/node.sh, mode ``node``) says on its stderr, in one place.

The node program is shell on the start path and spells these keywords in its ``echo`` lines;
this module owns their formats and the one parser of them (:func:`parse_line`), and
tests/unit/test_protocol_unit.py runs the real node program and parses its real output, and holds
node.sh to the keywords named here.

stdin (launcher -> node)::

    NAME=VALUE\\0 ... \\0        the environment, then one more NUL (:func:`env_payload`)
    \\n                         a ping, every second (the node's watchdog)
    stop\\n                     the launcher stops the job (it records nothing then)

stderr (node -> launcher), a line each::

    ftb-gpu                        the host has nvidia-smi (a failed run reads its kernel log)
    ftb-pid PID                    the job runs (PID of its session leader)
    ftb-hb [BYTES [STEP_BYTES]]    a heartbeat; with the stall watchdog on, the ranks' output
                                   size (and rank 0's trainer log's): :func:`parse_progress`
    ftb-steps R N MED P90 [TOK S][;...]
                                   the local ranks' step times (and a script's tokens), when they changed
    ftb-storage SECONDS [STATE WCHAN LOAD]
                                   a reading of shared storage unanswered that long (with how
                                   its process waits when that is not the storage: starved)
    ftb-storage ok                 ... answered again
    ftb-smi IDX, UTIL, ...[;...]   a reading of the job's GPUs, every few seconds (one nvidia-smi
                                   loop: ftbundle/gpu_metrics.py reads it)
    anything else                  the node program's own words ("ftbundle: ..."), shown
"""

from __future__ import annotations

from dataclasses import dataclass

# -- launcher -> node (stdin) -----------------------------------------------------------------
PING = b"\n"
STOP_LINE = b"stop\n"

# -- node -> launcher (stderr): the keywords node.sh echoes ----------------------------------
GPU = "ftb-gpu"
PID = "ftb-pid"
HEARTBEAT = "ftb-hb"
STEPS = "ftb-steps"
STORAGE = "ftb-storage"
STORAGE_OK = "ok"
SMI = "ftb-smi"
KEYWORDS = (GPU, PID, HEARTBEAT, STEPS, STORAGE, SMI)

# what parse_line says a line is
GPU_LINE, PID_LINE, HB_LINE, STEPS_LINE, STORAGE_LINE, SMI_LINE, MESSAGE = (
    "gpu", "pid", "hb", "steps", "storage", "smi", "msg")
_KINDS = {GPU: GPU_LINE, PID: PID_LINE, HEARTBEAT: HB_LINE, STEPS: STEPS_LINE, STORAGE: STORAGE_LINE, SMI: SMI_LINE}


def env_payload(env: dict[str, str]) -> bytes:
    """What stdin starts with: each NAME=VALUE pair followed by a NUL, then one more NUL (no
    shell syntax: the node exports each pair as it is, whatever its value holds; newlines
    included). NUL is the one byte no environment value can hold, so bash's own ``read -d ''``
    takes the pairs apart: no decoder process on the node (a job's env value with a NUL is
    refused when the job is loaded)."""
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()) + b"\0"


@dataclass(frozen=True)
class Line:
    """One line of a node's control channel: its kind (above) and what follows the keyword
    (the whole line for a message)."""

    kind: str
    text: str


def parse_line(raw: bytes) -> Line:
    """A line as the node program wrote it (without its newline). A keyword counts only as the
    line's first word: a job's message that merely contains one is a message."""
    text = raw.decode(errors="replace")
    word, _, rest = text.partition(" ")
    kind = _KINDS.get(word)
    if kind is None or (kind == GPU_LINE and rest):
        return Line(MESSAGE, text)
    return Line(kind, rest.strip())


def parse_progress(text: str) -> tuple[int, int | None] | None:
    """A heartbeat's progress (what follows ``ftb-hb``): (the ranks' output bytes, rank 0's
    trainer log bytes or None); None for a bare heartbeat or one that is not a reading."""
    words = text.split()
    try:
        return (int(words[0]), int(words[1]) if len(words) > 1 else None) if words else None
    except ValueError:
        return None


@dataclass(frozen=True)
class StorageReport:
    """An ``ftb-storage`` report: a reading unanswered for ``seconds``, with how its process
    waits (``state`` None: not at its program yet; "S" for the bare form: the node saw it held
    in the kernel), or ``ok``: it answered again."""

    ok: bool
    seconds: float = 0.0
    state: str | None = None
    wchan: str = ""
    load: float | None = None


def parse_storage(text: str) -> StorageReport | None:
    """What follows ``ftb-storage``: ``ok``, ``SECONDS`` or ``SECONDS STATE WCHAN LOAD`` ("-"
    for no state, "?" for no load); None when it is none of them."""
    if text == STORAGE_OK:
        return StorageReport(ok=True)
    words = text.split()
    try:
        seconds = float(words[0])
        if len(words) == 1:
            return StorageReport(False, seconds, "S")
        state, wchan, load = words[1], words[2], words[3]
        return StorageReport(False, seconds, None if state == "-" else state, wchan,
                             None if load == "?" else float(load))
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class RankSteps:
    """One rank's own step times, as an ``ftb-steps`` part says them."""

    local_rank: int
    steps: int
    median_s: float
    p90_s: float
    tokens: int | None = None  # a script's count (StepClock.step_done(tokens=N)), since its first counted step
    tokens_s: float | None = None  # ... over this many seconds of its own clock
    params: int | None = None  # the script's model's parameters (StepClock.watch), for MFU


def parse_steps(text: str) -> list[RankSteps]:
    """The ranks' parts an ``ftb-steps`` line carries ("LOCAL_RANK STEPS MEDIAN P90", then
    "TOKENS SECONDS" where the script counts its tokens, then "PARAMS" where its model's were
    counted; ';' between ranks); a part that is not one is skipped (a file caught mid-write)."""
    ranks = []
    for part in text.split(";"):
        fields = part.split()
        if len(fields) not in (4, 6, 7):
            continue
        try:
            counted = (int(fields[4]), float(fields[5])) if len(fields) >= 6 else (None, None)
            params = int(fields[6]) if len(fields) == 7 else None
            rank = RankSteps(int(fields[0]), int(fields[1]), float(fields[2]), float(fields[3]), *counted,
                             params=params if params and params > 0 else None)
        except ValueError:
            continue
        if rank.steps > 0 and rank.median_s >= 0 and rank.p90_s >= 0:
            ranks.append(rank)
    return ranks
