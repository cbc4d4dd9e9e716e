"""The run directory: every name under ``<shared_dir>/runs/<run id>``, in one place.

A run directory lives on shared storage and is the contract between the launcher (which
writes the plan and the record, and reads the nodes' files back for ``runs``, ``status``,
``logs``, ``plot`` and the exports) and the node program on every host (which writes each
node's log, pid, exit, heartbeat and step files). Both sides take the names from here: the
launcher through :class:`RunDir` and :class:`NodeFiles`, the node program through the
environment :meth:`NodeFiles.env` and :meth:`RunDir.env` give it (launch/node.py's
``node_env``); node.sh and the detached watcher spell none of them.

Layout (``aN``: attempt N, a restart's files beside the first's; ``R``: node rank)::

    plan.json                   the plan, secrets redacted (written before any node starts)
    attempt                     the number of the attempt now running (a fenced rank reads it)
    attempts.json               each attempt's hosts and why they changed
    summary.json                the run's end as the launcher saw it (state, exit, loss, ...)
    metrics.jsonl               the trainer's log records of every attempt (``plot``)
    trackers.json               the MLflow and W&B runs rank 0 logs to (written by its entry)
    tensorboard/, wandb/        TensorBoard's events and W&B's files, when report_to names them
    stop-requested              ``ftbundle stop`` asks every (detached) node to stop
    watch.aN                    a detached run's referee verdict (rank 0's watcher)
    stalled.aN                  a detached run's stall, found by rank 0's watchdog
    ended.aN                    a detached run's end as its watcher judged it (JSON, as summary.json: state,
                                exit, duration, hosts, loss, tokens/s, the failure); the one watcher that
                                tells the end claims it (O_EXCL), then writes it whole; `runs` reads it
    diverged.aN                 the loss went nan or the model collapsed (JSON: step, since, kind, said),
                                by global rank 0's trainer callback (shims/steptimes.py); no restart follows
    stacks/                     ranks' stacks, one folder per collection
    stacks.py                   the stack collector, staged for detached nodes
    ranks/node-R/               torchrun's --log-dir of node R
    node-R-HOST.aN.log          node R's log (rank 0's is the one the terminal shows)
    node-R.aN.{pid,exit,hb,stopped,steps,xids,progress,stacked,gpumetrics}
    llamafactory.yaml, ftb_llamafactory.py, ftb_steptimes.py, deepspeed.json, nccl-trace-rank-*
                                staged for the ranks (and the burn-in's and net check's own)

Pure: names only, no I/O.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

RUNS = "runs"  # under shared_dir: one folder per run

PLAN = "plan.json"
ATTEMPT = "attempt"
ATTEMPTS = "attempts.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
TRAINER_LOG = "trainer_log.jsonl"  # LlamaFactory's LogCallback, in output_dir (not the run directory)
STOP_REQUEST = "stop-requested"
STACKS = "stacks"
STACKS_PROGRAM = "stacks.py"
RANKS = "ranks"  # torchrun's --log-dir, one folder per node
WATCHER_PROGRAM = "watch.py"  # the detached watcher, staged for detached nodes (remote/watch.py)
TELLER_PROGRAM = "tell.py"  # an attached run's word when its launcher is lost, rank 0's (remote/tell.py)
# staged by the launcher before the nodes start (runtimes, check/burnin.py, check/net.py, export/shell.py)
LLAMAFACTORY_CONFIG = "llamafactory.yaml"  # the job's LlamaFactory config, as the ranks read it
TENSORBOARD = "tensorboard"  # TensorBoard's logging_dir, when the config reports to it (ftbundle/trackers.py)
TRACKER_RUNS = "trackers.json"  # the tracker runs rank 0 logs to (shims/llamafactory_entry.py writes it)
LLAMAFACTORY_ENTRY = "ftb_llamafactory.py"  # ftbundle/shims/llamafactory_entry.py, beside it
STEPTIMES = "ftb_steptimes.py"  # ftbundle/shims/steptimes.py: the ranks' step times (stragglers)
DEEPSPEED_CONFIG = "deepspeed.json"  # the config's `deepspeed:` file, when it is beside the config
NCCL_TRACE_PREFIX = "nccl-trace-rank-"  # torch's flight recorder dumps; torch appends the global rank
BURNIN_SCRIPT = "ftb_burnin.py"  # `check --burn-in`'s load (shims/burnin.py)
BURNIN_RESULT = "burnin.json"  # one per node: node-R.json under the burn-in's own run directory
BURNIN_READY = "ready"  # the burn-in's nodes say they are ready here, one file per node
NET_BENCH_SCRIPT = "ftb_allreduce_bench.py"  # `check --net`'s all-reduce (shims/allreduce_bench.py)
NET_BENCH_RESULT = "allreduce.json"  # rank 0's result
SHELL_NODE_FILE = "ftb-node.sh"  # `export --to shell`: the script every node runs

# each node's files of one attempt: node-R.aN.<kind>
NODE_KINDS = ("pid", "exit", "hb", "stopped", "steps", "xids", "progress", "stacked", "gpumetrics")
_NODE_FILE = re.compile(r"node-(\d+)\.a(\d+)\.([a-z]+)$")
_NODE_LOG = re.compile(r"node-(\d+)-(.+)\.a(\d+)\.log$")


CHECKS = "checks"  # under shared_dir: one folder per check that keeps something (check --burn-in)


def runs_dir(shared_dir: str) -> str:
    """``<shared_dir>/runs``: every run of every job on that storage."""
    return posixpath.join(shared_dir, RUNS)


TOKENIZED = "cache/tokenized"  # under shared_dir: LlamaFactory's tokenized datasets, one folder per key


def tokenized_dir(shared_dir: str) -> str:
    """``<shared_dir>/cache/tokenized``: tokenized datasets kept for every later run (ftbundle/tokenized.py)."""
    return posixpath.join(shared_dir, TOKENIZED)


GEMM = "gemm.json"  # under checks/: the bf16 GEMM the last burn-in of each GPU measured on it (check/burnin.py)


def gemm_record(shared_dir: str) -> str:
    """``<shared_dir>/checks/gemm.json``: what a later run counts MFU against where ftbundle's
    table knows no data-sheet peak for its GPUs (ftbundle/speed.py ``basis_of``)."""
    return posixpath.join(shared_dir, CHECKS, GEMM)


def check_dir(shared_dir: str, run_id: str) -> str:
    """``<shared_dir>/checks/<run id>``: a check's own job (the burn-in) and what it keeps."""
    return posixpath.join(shared_dir, CHECKS, run_id)


def node_name(rank: int | str, attempt: int | str, kind: str) -> str:
    """``node-R.aN.KIND``, a node's file's name in its run directory (``*`` for R: every node's)."""
    if kind not in NODE_KINDS:
        raise ValueError(f"not a node file kind: {kind!r}")
    return f"node-{rank}.a{attempt}.{kind}"


def node_glob(attempt: int | str, kind: str) -> str:
    """Every node's ``KIND`` file of one attempt (``*`` for N: of every attempt)."""
    return node_name("*", attempt, kind)


def node_log_name(rank: int, host: str, attempt: int = 1) -> str:
    """A node's log in the run directory; each attempt (restart) writes a log of its own."""
    return f"node-{rank}-{host}.a{attempt}.log"


def parse_node_name(name: str) -> tuple[int, int, str] | None:
    """``node-R.aN.KIND`` -> (R, N, KIND); a node log ``node-R-HOST.aN.log`` -> (R, N, "log");
    None for any other name."""
    m = _NODE_FILE.match(name)
    if m and m.group(3) in NODE_KINDS:
        return int(m.group(1)), int(m.group(2)), m.group(3)
    m = _NODE_LOG.match(name)
    if m:
        return int(m.group(1)), int(m.group(3)), "log"
    return None


def burnin_node_result(rank: int) -> str:
    """One node's burn-in figures in the check's directory (shims/burnin.py writes it)."""
    return f"node-{rank}.json"


def verdict_name(attempt: int | str) -> str:
    return f"watch.a{attempt}"


def stalled_name(attempt: int | str) -> str:
    return f"stalled.a{attempt}"


def ended_name(attempt: int | str) -> str:
    return f"ended.a{attempt}"


def diverged_name(attempt: int | str) -> str:
    """Written by the ranks' callback (shims/steptimes.py ``diverged``: the same name, spelt there)."""
    return f"diverged.a{attempt}"


def detached_stacks_name(attempt: int | str) -> str:
    """Under stacks/: what the detached nodes collected when their watchdog found a stall."""
    return f"a{attempt}-stall-detached"


def marker(run_id: str, rank: int, attempt: int) -> str:
    """FTB_JOB of every process of one node's job of one attempt: how `stop` finds them all."""
    return f"{run_id}.a{attempt}-{rank}"


@dataclass(frozen=True)
class NodeFiles:
    """One node's files of one attempt, in the run directory on shared storage."""

    log: str
    pid: str  # "PID MARKER HOSTNAME" of the job
    exit: str  # the job's exit code, once it ended
    hb: str  # a detached node's heartbeat counter
    stopped: str  # why the node program stopped its job by itself (launcher lost, storage)
    steps: str  # a detached node's ranks' step times, kept by its watcher
    xids: str  # the GPU faults its kernel logged while a detached job ran
    progress: str  # a detached node's ranks' progress (its stall watchdog)
    stacked: str  # a detached node collected its ranks' stacks
    gpumetrics: str  # a detached GPU node's mean utilization and peak memory, kept by its watcher
    marker: str  # FTB_JOB of every process of the job: how stop finds them all

    @classmethod
    def of(cls, run_dir: str, run_id: str, rank: int, host: str, attempt: int) -> NodeFiles:
        paths = {kind: posixpath.join(run_dir, node_name(rank, attempt, kind)) for kind in NODE_KINDS}
        return cls(log=posixpath.join(run_dir, node_log_name(rank, host, attempt)),
                   marker=marker(run_id, rank, attempt), **paths)

    def env(self) -> dict[str, str]:
        """The node program's and the watcher's names for this node's files."""
        return {"FTB_LOG": self.log, "FTB_EXIT": self.exit, "FTB_PIDFILE": self.pid, "FTB_HBFILE": self.hb,
                "FTB_MARKER": self.marker, "FTB_STOPPED_FILE": self.stopped, "FTB_KEPT_STEPS_FILE": self.steps,
                "FTB_XIDS_FILE": self.xids, "FTB_PROGRESS_FILE": self.progress, "FTB_STACKED_FILE": self.stacked,
                "FTB_KEPT_GPUS_FILE": self.gpumetrics}


@dataclass(frozen=True)
class RunDir:
    """A run directory and every path under it: ``<shared_dir>/runs/<run id>`` for a run
    (:meth:`of`), ``<shared_dir>/checks/<run id>`` for a check's own job (:func:`check_dir`)."""

    path: str
    run_id: str

    @classmethod
    def of(cls, shared_dir: str, run_id: str) -> RunDir:
        return cls(posixpath.join(runs_dir(shared_dir), run_id), run_id)

    @classmethod
    def at(cls, path: str) -> RunDir:
        """The run directory at ``path`` (``<shared_dir>/runs/<run id>``)."""
        path = path.rstrip("/")
        parent, run_id = posixpath.split(path)
        if posixpath.basename(parent) != RUNS or not run_id:
            raise ValueError(f"not a run directory (<shared_dir>/{RUNS}/<run id>): {path}")
        return cls(path, run_id)

    @property
    def shared_dir(self) -> str:
        """The shared storage it lives on (``<shared_dir>/runs/<id>`` or ``.../checks/<id>``)."""
        return posixpath.dirname(posixpath.dirname(self.path))

    def __str__(self) -> str:
        return self.path

    def join(self, *names: str) -> str:
        return posixpath.join(self.path, *names)

    @property
    def plan(self) -> str:
        return self.join(PLAN)

    @property
    def attempt(self) -> str:
        return self.join(ATTEMPT)

    @property
    def attempts(self) -> str:
        return self.join(ATTEMPTS)

    @property
    def summary(self) -> str:
        return self.join(SUMMARY)

    @property
    def metrics(self) -> str:
        return self.join(METRICS)

    @property
    def stop_request(self) -> str:
        return self.join(STOP_REQUEST)

    @property
    def stacks(self) -> str:
        return self.join(STACKS)

    @property
    def stacks_program(self) -> str:
        return self.join(STACKS_PROGRAM)

    @property
    def watcher_program(self) -> str:
        return self.join(WATCHER_PROGRAM)

    @property
    def teller_program(self) -> str:
        return self.join(TELLER_PROGRAM)

    @property
    def ranks(self) -> str:
        return self.join(RANKS)

    def rank_logs(self, rank: int) -> str:
        """torchrun's --log-dir of node ``rank``."""
        return self.join(RANKS, f"node-{rank}")

    def verdict(self, attempt: int) -> str:
        return self.join(verdict_name(attempt))

    def stalled(self, attempt: int) -> str:
        return self.join(stalled_name(attempt))

    def ended(self, attempt: int) -> str:
        return self.join(ended_name(attempt))

    def diverged(self, attempt: int) -> str:
        return self.join(diverged_name(attempt))

    def detached_stacks(self, attempt: int) -> str:
        return self.join(STACKS, detached_stacks_name(attempt))

    def stacks_collection(self, label: str, stamp: str) -> str:
        """Under stacks/: one collection of every rank's stack (``label``: its attempt and why)."""
        return self.join(STACKS, f"{label}-{stamp}")

    def progress_globs(self, rank: int, host: str) -> list[str]:
        """What node ``rank`` counts as its ranks' output (the stall watchdog's progress): its
        log (local rank 0, every attempt) and the other local ranks' files under torchrun's
        --log-dir."""
        return [self.join(node_log_name(rank, host, 0).replace(".a0.", ".a*.")),
                posixpath.join(self.rank_logs(rank), "*", "*", "*", "*.log")]

    def node(self, rank: int, host: str, attempt: int) -> NodeFiles:
        return NodeFiles.of(self.path, self.run_id, rank, host, attempt)

    def node_glob(self, attempt: int | str, kind: str) -> str:
        return self.join(node_glob(attempt, kind))

    def env(self, attempt: int) -> dict[str, str]:
        """The run-wide names the node program and a detached watcher read."""
        return {"FTB_RUN_DIR": self.path, "FTB_STOP_REQUEST": self.stop_request,
                "FTB_VERDICT_FILE": self.verdict(attempt), "FTB_STALLED_FILE": self.stalled(attempt),
                "FTB_ENDED_FILE": self.ended(attempt), "FTB_DIVERGED_FILE": self.diverged(attempt),
                "FTB_STACKS_OUT": self.detached_stacks(attempt), "FTB_STACKS_PROGRAM": self.stacks_program,
                "FTB_PEER_EXIT_GLOB": self.node_glob(attempt, "exit"),
                "FTB_PEER_HB_GLOB": self.node_glob(attempt, "hb"),
                "FTB_PEER_PROGRESS_GLOB": self.node_glob(attempt, "progress"),
                "FTB_PEER_STACKED_GLOB": self.node_glob(attempt, "stacked")}
