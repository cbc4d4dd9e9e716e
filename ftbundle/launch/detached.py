"""A detached run's start: every node's job started, then left to its node's watcher.

No supervisor stays: each node's watcher stops its job when a peer fails or goes silent
(heartbeat files on shared storage). A run that did not start on every node is stopped on
the others (they would wait in torch's rendezvous for a peer that never comes).
"""

from __future__ import annotations

import queue
import sys
import time
from typing import TextIO

from ..cluster import Cluster, parallel
from ..plan import Plan
from .node import Event, NodeRunner, start_behind
from .states import START_TIMEOUT_S


def launch_detached(plan: Plan, cluster: Cluster, err: TextIO | None = None, before=None) -> int:
    """Start every node's job and return once all have started; each node's watcher then
    stops its job when a peer fails or goes silent (heartbeat files on shared storage).
    ``before`` as for :func:`.attempts.launch`."""
    err = err or sys.stderr
    events: queue.Queue[Event] = queue.Queue()
    runners = [NodeRunner(n, plan, cluster, events, detach=True) for n in plan.nodes]
    start_behind(runners, before)
    pending = {r.rank for r in runners}
    failed = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        try:
            event = events.get(timeout=0.5)
        except queue.Empty:
            continue
        if event.kind in ("exit", "lost"):
            pending.discard(event.rank)
            if event.code != 0:
                failed.append((event.rank, event.text or f"exit code {event.code}"))
    failed += [(rank, "did not answer") for rank in sorted(pending)]
    for rank, why in failed:
        extra = " / ".join(runners[rank].messages[-2:])
        print(f"ftbundle: node rank {rank} {plan.nodes[rank].host.name} did not start: {why}"
              + (f" ({extra})" if extra else ""), file=err)
    if failed:
        # the others wait in torch's rendezvous for a peer that will never come (600 s):
        # a run that did not start everywhere is stopped everywhere
        t0 = time.monotonic()
        stopped = parallel(lambda runner: runner.stop(), runners)
        left = [runners[i].node.host.name for i, ok in enumerate(stopped) if not ok]
        print(f"ftbundle: the run did not start on every node: stopped it on the others in "
              f"{time.monotonic() - t0:.1f}s" + (f"; could not confirm it stopped on {', '.join(left)}" if left else ""),
              file=err)
    return 1 if failed else 0
