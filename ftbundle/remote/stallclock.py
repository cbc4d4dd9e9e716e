"""The stall rule, once: :class:`StallClock`, the launcher's (ftbundle/launch/stall.py, attached
runs) and a detached run's watcher's (ftbundle/remote/watch.py, on rank 0's host).

Standard library only, no annotation a Python 3.6 cannot read: this file's text is shipped to the
hosts as the first part of the detached watcher's program (launch/stall.py ``watcher_source``),
where nothing of ftbundle can be imported.
"""


class StallClock:
    """Progress as the nodes report it (``BYTES`` or, from rank 0 of a LlamaFactory job,
    ``BYTES STEPS_BYTES``); pure (times are given). With ``wait_for_step`` the clock starts
    only once the trainer's log has its first step."""

    def __init__(self, timeout, wait_for_step=False):
        self.timeout = timeout
        self.wait_for_step = wait_for_step
        self.stepped = False
        self.last = {}  # rank -> its last reading
        self.last_progress = None  # None: no progress yet, the clock has not started

    def observe(self, rank, value, at):
        if not value:
            return
        parts = value.split()
        if len(parts) > 1 and parts[1] != "0":
            self.stepped = True
        before = self.last.get(rank)
        self.last[rank] = value
        if before is not None and before != value and (self.stepped or not self.wait_for_step):
            self.last_progress = at  # (the first reading is the baseline: an earlier attempt's output)

    def silent_for(self, now):
        return 0.0 if self.last_progress is None else now - self.last_progress

    def stalled(self, now):
        return bool(self.timeout) and self.last_progress is not None and now - self.last_progress > self.timeout
