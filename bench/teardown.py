"""Benchmark: time from a fault to "every node stopped", ftbundle vs hand-run torchrun.

The baseline is what the seeds describe: `torchrun --nnodes N --node_rank R ...` started
on every node over plain ssh. For each fault (a node's host dies; a node's network is
cut) it measures how long until no process of the job is left on the surviving hosts,
with the same all-reduce job (tests/assets/allreduce.py, gloo) on the same containerized
cluster. The baseline is given a cap (default 60 s): past it, it is reported as ">cap".

Then ftbundle alone, repeated on one cluster (issue 9's targets): a killed rank (10
trials: median at most 3 s, worst at most 5 s from the kill until ftbundle has exited with
every host clean), Ctrl-C (every host clean within 3 s), a partitioned node (the others
stopped and ftbundle exited within 10 s).

    .venv/bin/python bench/teardown.py [--nodes 3] [--cap 60] [--trials 10]
    .venv/bin/python bench/teardown.py --scale 128 [--trials 5]

Prints tables and the ratio baseline/ftbundle measured in this one run.

``--scale N`` (issue 23, item 2): the same killed-rank and Ctrl-C faults on N hosts, with a
job that is not torch (N torch ranks do not fit in this machine's memory at 128): a per-node
`command:` that marks its host as started and sleeps. The containers' processes are visible
in this machine's /proc, so "nothing left on any host" is read there in one scan (every
process whose environment carries the run's FTB_JOB marker), every 50 ms, not with N docker
execs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import Cluster, ensure_image  # noqa: E402
from tests.support.helpers import ASSETS, base_job, job_processes, marked_pids, sigint_ready, write_job  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from common import HOST_PYTHON, first_failure, median, table, write_section  # noqa: E402


def survivors_busy(cluster: Cluster, fault_host: str, pattern: str) -> bool:
    for host in cluster.hosts:
        if host.name == fault_host or not cluster.is_running(host):
            continue
        if cluster.pgrep(host, pattern):
            return True
    return False


def inject(cluster: Cluster, fault: str, host: str) -> None:
    if fault == "host dies":
        cluster.kill(host)
    else:
        cluster.partition(host)


def wait_steps(stream, needle: str = "step 3 allreduce ok", timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            raise RuntimeError("job ended before it got going")
        if needle in line:
            return
    raise RuntimeError("job never got going")


def allreduce_job(cluster: Cluster, shared: Path) -> Path:
    """The all-reduce loop (tests/assets/allreduce.py) as a job on the cluster's hosts."""
    shutil.copy(ASSETS / "allreduce.py", shared / "allreduce.py")
    inventory = cluster.write_inventory(shared / "hosts.yml")
    return write_job(shared / "job.yaml", base_job("bench", shared, inventory,
                                                   {"script": "allreduce.py", "args": ["--sleep", "0.2"]}))


def run_ftbundle(fault: str, nodes: int, cap: float) -> float:
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-", dir="/tmp"))
    try:
        with Cluster(nodes, shared_dir=shared) as cluster:
            job = allreduce_job(cluster, shared)
            proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", "-v", str(job)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, cwd=REPO)
            try:
                wait_steps(proc.stdout)
                victim = cluster.hosts[-1].name
                start = time.monotonic()
                inject(cluster, fault, victim)
                while survivors_busy(cluster, victim, "allreduce.py") and time.monotonic() - start < cap:
                    time.sleep(0.1)
                return time.monotonic() - start
            finally:
                proc.kill()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def run_baseline(fault: str, nodes: int, cap: float) -> float:
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-", dir="/tmp"))
    try:
        with Cluster(nodes, shared_dir=shared) as cluster:
            shutil.copy(ASSETS / "allreduce.py", shared / "allreduce.py")
            master = cluster.hosts[0].ip
            procs = []
            for rank, host in enumerate(cluster.hosts):
                cmd = (f"cd {shared} && GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 {HOST_PYTHON} -m "
                       f"torch.distributed.run --nnodes {nodes} --nproc_per_node 1 --node_rank {rank} "
                       f"--master_addr {master} --master_port 29500 allreduce.py --sleep 0.2")
                procs.append(subprocess.Popen(cluster.ssh_argv(host) + [cmd], stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True))
            try:
                wait_steps(procs[0].stdout)
                victim = cluster.hosts[-1].name
                start = time.monotonic()
                inject(cluster, fault, victim)
                while survivors_busy(cluster, victim, "allreduce.py") and time.monotonic() - start < cap:
                    time.sleep(0.1)
                return time.monotonic() - start
            finally:
                for p in procs:
                    p.kill()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def ftbundle_trial(cluster: Cluster, job: Path, fault: str) -> float:
    """Seconds from the fault until ftbundle has exited and no job process is left on any
    reachable host (for a partition: until ftbundle has exited)."""
    import signal

    argv = sigint_ready([sys.executable, "-m", "ftbundle", "run", "-v", str(job), "--no-check"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        wait_steps(proc.stdout, needle="step 2 allreduce ok")
        victim = cluster.hosts[-1]
        start = time.monotonic()
        if fault == "killed rank":
            cluster.exec(victim, "pkill -KILL -f allreduce.py")
        elif fault == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            cluster.partition(victim)
        proc.wait(timeout=60)
        if fault != "partition":
            while job_processes(cluster) and time.monotonic() - start < 30:
                time.sleep(0.05)
        return time.monotonic() - start
    finally:
        proc.kill()
        if fault == "partition":
            cluster.heal(cluster.hosts[-1])
            deadline = time.monotonic() + 30  # its own watchdog stops its job
            while job_processes(cluster) and time.monotonic() < deadline:
                time.sleep(0.5)


def trials(nodes: int, count: int) -> list[list]:
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-", dir="/tmp"))
    rows = []
    try:
        with Cluster(nodes, shared_dir=shared) as cluster:
            job = allreduce_job(cluster, shared)
            for fault, n, target in (("killed rank", count, "median <= 3 s, worst <= 5 s"),
                                     ("ctrl-c", max(3, count // 2), "every host clean <= 3 s"),
                                     ("partition", 3, "others stopped, exited <= 10 s")):
                times = [ftbundle_trial(cluster, job, fault) for _ in range(n)]
                print(fault, [f"{t:.2f}" for t in times], flush=True)
                rows.append([fault, n, f"{median(times):.2f}", f"{max(times):.2f}", target])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return rows


def job_pids(name: str) -> list[int]:
    """Processes on this machine, the containers' included, of any run of job ``name``
    (every process ftbundle starts for a job carries FTB_JOB=<run>...)."""
    return marked_pids(f"{name}-", prefix=True)


def scale_trial(cluster: Cluster, job: Path, name: str, shared: Path, fault: str, trial: int) -> dict:
    """One fault on a running per-node job across the whole cluster: seconds from the fault
    until ftbundle exited, and until no process of the job was left anywhere."""
    import signal

    up = shared / "up"
    shutil.rmtree(up, ignore_errors=True)
    up.mkdir()
    argv = sigint_ready([sys.executable, "-m", "ftbundle", "run", str(job), "--no-check"])
    # stderr to a file, not a pipe nobody reads while the run lasts (a full pipe would hold ftbundle)
    err_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err_file, text=True, cwd=REPO)

    def said() -> str:
        err_file.seek(0)
        return err_file.read()

    try:
        deadline = time.monotonic() + 300
        while len(list(up.iterdir())) < len(cluster.hosts):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trial {trial}: {len(list(up.iterdir()))} of {len(cluster.hosts)} hosts started "
                                   f"(ftbundle rc {proc.poll()}): {said()[-2000:]}")
            time.sleep(0.1)
        victim = cluster.hosts[-1]
        start = time.monotonic()
        if fault == "killed rank":
            cluster.exec(victim, "pkill -KILL -x sleep")
        else:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        exited = time.monotonic() - start
        while job_pids(name) and time.monotonic() - start < 60:
            time.sleep(0.05)
        clean = time.monotonic() - start
        first = first_failure(said())  # it must name the victim's node
        return {"exited": exited, "clean": clean, "left": len(job_pids(name)), "rc": proc.returncode,
                "named": f"node {victim.name} " in first if fault == "killed rank" else True, "first": first}
    finally:
        if proc.poll() is None:
            proc.kill()
        err_file.close()


def scale(nodes: int, count: int) -> None:
    """Issue 23, item 2: teardown at ``nodes`` hosts, within the bounds it has at 2 or 3."""
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-", dir="/tmp"))
    name = f"teardown{nodes}"
    rows = []
    try:
        with Cluster(nodes, shared_dir=shared) as cluster:
            inventory = cluster.write_inventory(shared / "hosts.yml")
            # a per-node command, not torch; `exec`: the sleep is the node's job process itself
            job = write_job(shared / "job.yaml", base_job(name, shared, inventory, {
                "command": f"touch {shared}/up/$(hostname) && exec sleep 86400"}))
            for fault, target in (("killed rank", "median <= 3 s, worst <= 5 s"),
                                  ("ctrl-c", "every host clean <= 3 s")):
                results = [scale_trial(cluster, job, name, shared, fault, i) for i in range(count)]
                print(fault, results, flush=True)
                exited = [r["exited"] for r in results]
                clean = [r["clean"] for r in results]
                rows.append([fault, nodes, count, f"{median(exited):.2f}", f"{max(exited):.2f}",
                             f"{median(clean):.2f}", f"{max(clean):.2f}", max(r["left"] for r in results),
                             " ".join(str(r["rc"]) for r in results),
                             "yes" if all(r["named"] for r in results) else "no", target])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    write_section("teardown_scale", "\n".join([
        f"## Teardown at {nodes} hosts (issue 23)", "",
        f"{nodes} containerized hosts, each running a per-node `command:` (`sleep`, not torch: {nodes} torch "
        "ranks do not fit in this machine's memory), started with `ftbundle run --no-check`; the fault on the "
        "last host (its job process killed with SIGKILL, or Ctrl-C to ftbundle). Seconds from the fault until "
        "ftbundle exited, and until no process carrying the run's FTB_JOB marker was left on any host (read "
        "in this machine's /proc, which sees every container's processes, every 50 ms). `left`: such "
        "processes still there at the end (the most of any trial). `named`: the failure summary named the "
        "host whose rank was killed as the one that failed first, in every trial.", "",
        table(["fault", "hosts", "trials", "exited median s", "worst s", "all clean median s", "worst s", "left",
               "exit codes", "named", "target"], rows)]), rerun=f"bench/teardown.py --scale {nodes}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--scale", type=int, default=0, help="only the killed-rank and Ctrl-C trials on N hosts (--trials, at most 5, each)")
    args = parser.parse_args()
    ensure_image()
    if args.scale:
        return scale(args.scale, min(args.trials, 5))
    repeated = trials(args.nodes, args.trials)
    rows = []
    for fault in ("host dies", "network cut"):
        ours = run_ftbundle(fault, args.nodes, args.cap)
        base = run_baseline(fault, args.nodes, args.cap)
        base_s = f">{args.cap:.0f}" if base >= args.cap else f"{base:.1f}"
        rows.append([fault, f"{ours:.1f}", base_s, f"{'>' if base >= args.cap else ''}{base / ours:.1f}x"])
    md = ["## Teardown (issue 9)", "",
          f"{args.nodes} containerized hosts, a gloo all-reduce under torchrun, fault on the last host. "
          "Seconds from the fault until ftbundle has exited with no job process left on any reachable host.", "",
          table(["fault", "trials", "median s", "worst s", "target"], repeated), "",
          f"Against hand-run torchrun over ssh (the seeds' way), until every surviving node's job is gone "
          f"(cap {args.cap:.0f} s):", "",
          table(["fault", "ftbundle s", "hand-run torchrun s", "ratio"], rows)]
    write_section("teardown", "\n".join(md))


if __name__ == "__main__":
    main()
