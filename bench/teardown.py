"""Benchmark: time from a fault to "every node stopped", ftbundle vs hand-run torchrun.

The baseline is what the seeds describe: `torchrun --nnodes N --node_rank R ...` started
on every node over plain ssh. For each fault (a node's host dies; a node's network is
cut) it measures how long until no process of the job is left on the surviving hosts,
with the same all-reduce job (tests/assets/allreduce.py, gloo) on the same containerized
cluster. The baseline is given a cap (default 60 s): past it, it is reported as ">cap".

    .venv/bin/python bench/teardown.py [--nodes 3] [--cap 60]

Prints a table and the ratio baseline/ftbundle measured in this one run.
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

from tests.cluster import Cluster, ensure_image  # noqa: E402
from tests.helpers import ASSETS, base_job, write_job  # noqa: E402


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


def run_ftbundle(fault: str, nodes: int, cap: float) -> float:
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-", dir="/tmp"))
    try:
        with Cluster(nodes, shared_dir=shared) as cluster:
            shutil.copy(ASSETS / "allreduce.py", shared / "allreduce.py")
            inventory = cluster.write_inventory(shared / "hosts.yml")
            job = write_job(shared / "job.yaml", base_job("bench", shared, inventory,
                                                          {"script": "allreduce.py", "args": ["--sleep", "0.2"]}))
            proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", str(job)], stdout=subprocess.PIPE,
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
                cmd = (f"cd {shared} && GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 {sys.executable} -m "
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--cap", type=float, default=60.0)
    args = parser.parse_args()
    ensure_image()
    rows = []
    for fault in ("host dies", "network cut"):
        ours = run_ftbundle(fault, args.nodes, args.cap)
        base = run_baseline(fault, args.nodes, args.cap)
        rows.append((fault, ours, base))
    print(f"\nfault -> every surviving node's job gone ({args.nodes} hosts, gloo all-reduce, cap {args.cap:.0f}s)")
    print(f"{'fault':<14} {'ftbundle':>10} {'hand-run torchrun':>18} {'ratio':>8}")
    for fault, ours, base in rows:
        base_s = f">{args.cap:.0f}s" if base >= args.cap else f"{base:.1f}s"
        ratio = f"{'>' if base >= args.cap else ''}{base / ours:.1f}x"
        print(f"{fault:<14} {ours:>9.1f}s {base_s:>18} {ratio:>8}")


if __name__ == "__main__":
    main()
