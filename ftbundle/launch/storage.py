"""Shared storage that stops answering: named as such, not as a frozen node or a stalled rank.

A network filesystem that hangs (an NFS server gone, a frozen sshfs) hangs every process that
touches it, in the kernel, for as long as the freeze lasts; a signal only turns it to D state,
and ``kill -9`` leaves it there. The run's logs, its exit files and often its checkpoints live
there, so every rank soon waits on it: the run makes no progress, and without this the stall
watchdog would blame the ranks it finds in ``write``, or a node program caught in a ``stat``
would stop beating and be given up as "frozen or starved of CPU".

So the node program never touches shared storage from the loop that beats. Its progress
reading (one ``stat`` of the ranks' output files, every ``progress_every`` beats) runs in a
child it never waits for, and that ``stat`` also asks for a name under ``shared_dir`` that was
never used (no cache can answer it). A reading not answered for ``STORAGE_SLOW_S`` is the
storage not answering: every beat then says ``ftb-storage SECONDS`` on the node's control
channel (never through the storage), and ``ftb-storage ok`` once it answers
(ftbundle/remote/node.sh, ``ftb_ask``). :class:`StorageWatch` keeps what the nodes said, pure
(times are given), and words it: "shared storage /shared on node1 not answering for 14s".

A slow reading is the storage's only on evidence (ftbundle/remote/evidence.py): the node
program reads how its reading's process waits (``ftb_why``) and says it when that is not
blocked in the kernel: ``ftb-storage SECONDS STATE WCHAN LOAD``. A process runnable but not
run (R), or not at its program yet, is a host too busy to run it (its CPUs taken), not hung
storage: said once as such ("host node3 is starved: ..."), and only after ``STORAGE_PATIENCE_S``
more is the storage given up on. The bare ``ftb-storage SECONDS`` is the node's evidence that
the storage holds its reading (S or D).

What is decided on it stays where it was: the supervisor says it as soon as a node reports it,
and the run is stopped by the stall watchdog (``stall_timeout`` without progress), which then
names the storage instead of collecting the ranks' stacks (they would be written to that very
storage). A short freeze (an NFS server's failover) costs the run nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hostlist import fold
from ..protocol import parse_storage
from ..remote.evidence import HUNG, STARVED, storage_verdict, waits_in

STORAGE_SLOW_S = 5  # a reading of shared storage not answered this long, held by it: it does not answer
STORAGE_PATIENCE_S = 30  # ... and this much longer while its host has not run it (starved): given up then


@dataclass
class StorageWatch:
    """What the nodes said about their shared storage; ``hosts`` by node rank."""

    shared_dir: str
    hosts: list[str]
    since: dict[int, float] = field(default_factory=dict)  # node rank -> when it stopped answering
    starved: set[int] = field(default_factory=set)  # node ranks said to be too busy to run their reading

    def observe(self, rank: int, text: str, at: float) -> str | None:
        """One ``ftb-storage`` report (``SECONDS [STATE WCHAN LOAD]`` or ``ok``); what to tell the
        person watching, once per freeze (or starved host) and once when it is over, else None."""
        report = parse_storage(text)
        if report is None:
            return None
        if report.ok:
            self.starved.discard(rank)
            began = self.since.pop(rank, None)
            if began is None:
                return None
            return (f"shared storage {self.shared_dir} on {self.hosts[rank]} answers again "
                    f"(after {at - began:.0f}s)")
        waited, state, wchan, load = report.seconds, report.state, report.wchan, report.load
        # (the node reports a reading only once it is FTB_STORAGE_SLOW late: slow already)
        verdict = storage_verdict(state, wchan, True, waited, 0)
        seen = f"its process {waits_in(state, wchan)}{'' if load is None else f'; load {load:g}'}"
        if verdict != HUNG and waited < STORAGE_SLOW_S + STORAGE_PATIENCE_S:
            if verdict != STARVED or rank in self.starved:
                return None
            self.starved.add(rank)
            return (f"host {self.hosts[rank]} is starved: its reading of shared storage {self.shared_dir} has "
                    f"waited {waited:.0f}s to be run ({seen}): its CPUs are taken, not a hung filesystem; "
                    f"waiting up to {STORAGE_PATIENCE_S}s more")
        first = rank not in self.since
        self.since[rank] = min(at - waited, self.since.get(rank, at - waited))
        if not first:
            return None
        if verdict != HUNG:  # (given up on after the longer wait)
            return self.describe(at, [rank]) + f": its host too busy to run a reading of it all that time ({seen})"
        return (self.describe(at, [rank]) + ": every process that touches it waits (D state) until it "
                "answers")

    def stuck(self) -> list[int]:
        """The node ranks whose shared storage does not answer, in order."""
        return sorted(self.since)

    def describe(self, now: float, ranks: list[int] | None = None) -> str:
        """``shared storage /shared on node[0-1] not answering for 14s``."""
        ranks = self.stuck() if ranks is None else ranks
        longest = max(now - self.since[r] for r in ranks)
        return (f"shared storage {self.shared_dir} on {fold(self.hosts[r] for r in ranks)} "
                f"not answering for {longest:.0f}s")
