"""A node's state in an attempt, what the loop decides from it, and what an attempt ends with.

Each node goes STARTING -> RUNNING (its first heartbeat) -> EXITED (an exit code) or LOST.
Only the supervisor's loop (:mod:`.supervisor`) changes a state; what it does about a silent
node is decided here, without I/O (:func:`silence_verdict`), from the node's state, the time
and whether its host answered when asked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..ui.progress import Progress

START_TIMEOUT_S = 30.0  # STARTING for longer than this: the node program never ran
PROBE_S = 1.5  # a silent node's host must answer within this long, or the node is lost
LOST_EXIT_CODE = 255  # like ssh, for a node whose connection or heartbeat was lost
INTERRUPTED_EXIT_CODE = 130  # ctrl-c (128 + SIGINT), and a run stopped by `ftbundle stop`
AWAY_WINDOW_S = 5.0  # the nodes' stops queued while ftbundle was paused are read within this of its waking


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"


@dataclass
class NodeStatus:
    state: State = State.STARTING
    since: float = 0.0  # when the state was entered
    last_heartbeat: float | None = None
    pid: str | None = None
    code: int | None = None
    reason: str = ""


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
    interrupted: bool = False  # ctrl-c, or `ftbundle stop` (``requested``): no restart follows
    requested: bool = False  # stopped by `ftbundle stop` (its stop-requested file), not failed
    teardown_s: float | None = None
    lost: tuple[int, ...] = ()  # ranks that could not be confirmed stopped
    progress: Progress | None = None  # what rank 0 said about training (without -v)
    stalled: bool = False  # stopped by the stall watchdog (not a job's own exit code 124)
    # (monotonic) when the attempt began, had every node up, saw its first step, acted on a
    # failure (its teardown began): the recovery's parts (attempts.recovery)
    marks: dict[str, float] = field(default_factory=dict)
    gpu_faults: tuple[str, ...] = ()  # the Xids its nodes' kernels logged during it (_print_gpu_faults)
    # the nodes stopped their jobs themselves, their launcher lost (ftbundle paused past their watchdog,
    # or cut off from them all): "stopped: launcher lost", and rank 0's host may have told the end meanwhile
    launcher_lost: bool = False


class Silence(enum.Enum):
    """What a node's silence calls for (:func:`silence_verdict`)."""

    NONE = "none"  # not silent for long (or not running): nothing to do
    NOT_STARTED = "not started"  # STARTING for longer than START_TIMEOUT_S: lost
    WAIT = "wait"  # silent; its host is asked (or answered) and the limit is not reached: wait
    HOST_GONE = "host gone"  # silent past the limit, its host said nothing back: lost
    HOST_LATE = "host late"  # silent past the limit, its host did not answer within PROBE_S: lost
    QUIET = "quiet"  # its host answers, but silent past ``quiet_max``: lost (unless its words wait unread)

    @property
    def asks(self) -> bool:
        """Whether its host is to be asked if it answers (once per silence)."""
        return self not in (Silence.NONE, Silence.NOT_STARTED)


def silence_verdict(st: NodeStatus, now: float, answered: bool | None, *, limit: float,
                    quiet_max: float | None, ask_before: float) -> Silence:
    """What to do about a node, from its status, the time and what its host said when asked
    about this silence (``answered``: None until it is known, or when not asked yet).

    A node that has not started in START_TIMEOUT_S is lost. A running node silent for more
    than ``limit - ask_before`` has its host asked; past ``limit`` it is lost when its host
    does not answer (or not within PROBE_S of the limit). A node whose host answers is alive
    but quiet: lost after ``quiet_max`` of silence (None: never)."""
    if st.state is State.STARTING and now - st.since > START_TIMEOUT_S:
        return Silence.NOT_STARTED
    if st.state is not State.RUNNING:
        return Silence.NONE
    silent = now - st.last_heartbeat
    if silent <= limit - ask_before:
        return Silence.NONE
    if silent <= limit or answered is None and silent <= limit + PROBE_S:
        return Silence.WAIT
    if answered is False:
        return Silence.HOST_GONE
    if answered is None:
        return Silence.HOST_LATE
    if quiet_max is not None and silent > quiet_max:
        return Silence.QUIET
    return Silence.WAIT


def stopped_while_away(away: tuple[float, float] | None, first_at: float, code: int,
                       window: float = AWAY_WINDOW_S) -> bool:
    """Whether an attempt's first failure is its nodes' watchdog stopping their jobs because ftbundle
    itself was paused past it (``away``: when it woke, for how long; :meth:`.supervisor.Supervisor._pardon`),
    not a fault of theirs: the failure came in the pause or within ``window`` of the waking (its
    word waited in the connection), and it is the watchdog's SIGTERM or SIGKILL, or the node's
    connection gone. A pause that the nodes outlived (a blocked loop whose pingers went on) and a
    failure an hour later are not it."""
    if away is None:
        return False
    woke, gap = away
    return woke - gap <= first_at <= woke + window and code in (143, 137, LOST_EXIT_CODE)

