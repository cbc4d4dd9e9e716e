"""A node's GPU figures over a run: its mean utilization (each reading's mean over its GPUs, averaged
over the readings), each GPU's peak memory, and how many GPUs and readings there were.

One text for both keepers: the launcher's (ftbundle/gpu_metrics.py ``NodeGpus``, an attached run)
and a detached run's watcher on the node (remote/watch.py, shipped in launch/stall.py
``WATCH_PARTS``), so summary.json says the same of a node whichever kept it. Standard library
only."""


class GpuTally:
    """The run's totals of one node's readings."""

    def __init__(self):
        self.util_sum = 0.0
        self.readings = 0  # the readings that said a utilization
        self.gpus = 0  # in the latest reading
        self.peak_mib = {}  # GPU index -> the most memory it held
        self.total_mib = {}  # GPU index -> its memory

    def add(self, gpus):
        """One reading: ``(index, utilization %, memory used MiB, memory total MiB)`` for each of
        the node's GPUs, None for what it did not say. Its mean utilization (None: none said)."""
        utils = [util for _, util, _, _ in gpus if util is not None]
        self.gpus = len(gpus)
        util = sum(utils) / len(utils) if utils else None
        if util is not None:
            self.util_sum += util
            self.readings += 1
        for index, _, used, total in gpus:
            if used is not None:
                self.peak_mib[index] = max(self.peak_mib.get(index, 0.0), used)
            if total:
                self.total_mib[index] = total
        return util

    def absorb(self, later):
        """Add a later tally of the same node (a run's next attempt) to this one."""
        self.util_sum += later.util_sum
        self.readings += later.readings
        self.gpus = later.gpus or self.gpus
        for index, used in later.peak_mib.items():
            self.peak_mib[index] = max(self.peak_mib.get(index, 0.0), used)
        self.total_mib.update(later.total_mib)

    def record(self):
        """summary.json's figures of the node."""
        return {"gpus": self.gpus, "util_mean": round(self.util_sum / self.readings, 1) if self.readings else None,
                "mem_peak_mib": round(max(self.peak_mib.values())) if self.peak_mib else None,
                "mem_total_mib": round(max(self.total_mib.values())) if self.total_mib else None,
                "readings": self.readings}
