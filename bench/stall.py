"""Benchmark: a quietly hung rank, from the hang to the diagnosis and to "every node stopped".

2 containerized hosts x 2 ranks, gloo, tests/assets/stall.py (an all-reduce loop), the
job's ``stall_timeout`` (default 10 s here). Two kinds of hang, a few trials each:

* ``lock``: rank 3 deadlocks in a Python function of its own at step 3 (the others then
  wait in all_reduce). The hang's moment is when rank 0 printed step 2 plus the loop's
  sleep (0.5 s): the step that never completes starts then.
* ``sigstop``: rank 1's process is stopped from outside (``kill -STOP`` on its host, found
  by its RANK in /proc/*/environ), at a moment the benchmark knows exactly.

Measured from the hang: when ftbundle printed the odd one out ("diagnosed"), and when
ftbundle had exited with no process of the job left on any host ("all stopped"). The
floor is stall_timeout itself; what is above it is detection granularity (heartbeats every
second), the collection (each rank's CPU sampled over 2 s, py-spy) and the teardown.

And what the watchdog costs: ftbundle's own CPU over a healthy run of fixed length with
``stall_timeout`` on and off (per host and minute), and on a node the CPU of one progress
reading (one `stat` of every rank's output files, run with each heartbeat, once a second).

    .venv/bin/python bench/stall.py [--trials 2] [--stall-timeout 10]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import Cluster, ensure_image  # noqa: E402
from tests.support.helpers import ASSETS, base_job, job_processes, sigint_ready, write_job  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from common import measure, median, table, write_section  # noqa: E402

SLEEP = 0.5


def job_file(cluster: Cluster, shared: Path, name: str, stall_timeout: int, *args: str) -> Path:
    inventory = cluster.write_inventory(shared / "hosts.yml")
    job = base_job(name, shared, inventory, {"script": "stall.py", "args": list(args)}, nproc_per_node=2,
                   stall_timeout=stall_timeout, check=False)
    return write_job(shared / f"{name}.yaml", job)


def hang_trial(cluster: Cluster, shared: Path, how: str, stall_timeout: int) -> tuple[float, float]:
    """(seconds from the hang to the diagnosis, to every process gone)."""
    if how == "lock":
        job = job_file(cluster, shared, "bench-lock", stall_timeout, "--hang-rank", "3", "--how", "lock",
                       "--hang-at", "3", "--sleep", str(SLEEP))
    else:
        job = job_file(cluster, shared, "bench-stop", stall_timeout, "--sleep", str(SLEEP))
    proc = subprocess.Popen(sigint_ready([sys.executable, "-m", "ftbundle", "run", "-v", str(job)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    diagnosed: list[float] = []
    said: list[str] = []

    def read_err():
        for line in proc.stderr:
            said.append(line)
            if "the odd one out" in line and not diagnosed:
                diagnosed.append(time.monotonic())

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        needle = "step 2 allreduce ok"
        for line in proc.stdout:
            if needle in line:
                break
        else:
            proc.wait(10)
            reader.join(5)
            raise RuntimeError("the job never got going:\n" + "".join(said[-30:]))
        if how == "lock":
            hang = time.monotonic() + SLEEP
        else:
            host = cluster.hosts[0]
            cluster.exec(host, "for p in $(grep -lzx RANK=1 /proc/[0-9]*/environ | cut -d/ -f3); do "
                               "grep -qz FTB_JOB= /proc/$p/environ && grep -qz LOCAL_RANK= /proc/$p/environ "
                               "&& kill -STOP $p; done")
            hang = time.monotonic()
        proc.stdout.read()
        proc.wait(timeout=stall_timeout + 120)
        while job_processes(cluster) and time.monotonic() - hang < stall_timeout + 180:
            time.sleep(0.2)
        stopped = time.monotonic()
        reader.join(5)
        if proc.returncode != 124 or not diagnosed:
            raise RuntimeError(f"{how}: exit {proc.returncode}, diagnosed: {bool(diagnosed)}")
        return diagnosed[0] - hang, stopped - hang
    finally:
        proc.kill()


def controller_cpu(cluster: Cluster, shared: Path, stall_timeout: int, steps: int) -> tuple[float, float]:
    """(ftbundle's CPU seconds, wall seconds) over a healthy run of ``steps`` steps."""
    job = job_file(cluster, shared, f"bench-healthy-{stall_timeout}", stall_timeout, "--steps", str(steps),
                   "--sleep", str(SLEEP))
    m = measure([sys.executable, "-m", "ftbundle", "run", "-v", str(job)])
    if m.code != 0:
        raise RuntimeError(f"healthy run failed: {m.stderr.decode()[-2000:]}")
    return m.self_cpu_s, m.wall_s


def progress_reading_cpu_ms(cluster: Cluster, shared: Path) -> float:
    """CPU milliseconds of one progress reading on a host (ftbundle/remote/node.sh's
    ftb_progress with a run's real files), averaged over 200."""
    runs = sorted((shared / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    run = runs[-1]
    globs = f"{run}/node-1-*.a*.log {run}/ranks/node-1/*/*/*/*.log"
    script = (f"export FTB_PROGRESS_FILES='{globs}'; "
              "eval \"$(sed -n '/^ftb_progress()/,/^}/p' /dev/stdin)\"; "
              "for i in $(seq 200); do x=$(ftb_progress); done; times")
    node_sh = (REPO / "ftbundle" / "remote" / "node.sh").read_text()
    out = subprocess.run(["docker", "exec", "-i", cluster.hosts[1].container, "bash", "-c", script],
                         input=node_sh, capture_output=True, text=True, timeout=120).stdout.split()
    # `times`: shell user/sys, then children user/sys (e.g. 0m0.010s)
    def secs(text: str) -> float:
        m, s = text.rstrip("s").split("m")
        return int(m) * 60 + float(s)
    return sum(secs(t) for t in out[-4:]) / 200 * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--stall-timeout", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="steps of the healthy runs (0.5 s each)")
    parser.add_argument("--hangs", default="lock,sigstop", help="which hangs to inject (default: both)")
    args = parser.parse_args()
    ensure_image()
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-", dir="/tmp"))
    shutil.copy(ASSETS / "stall.py", shared / "stall.py")
    rows = []
    try:
        with Cluster(2, shared_dir=shared) as cluster:
            for how in args.hangs.split(","):
                results = [hang_trial(cluster, shared, how, args.stall_timeout) for _ in range(args.trials)]
                print(how, [f"{d:.1f}/{s:.1f}" for d, s in results], flush=True)
                diag = [d for d, _ in results]
                stop = [s for _, s in results]
                rows.append([how, len(results), f"{median(diag):.1f}", f"{max(diag):.1f}", f"{median(stop):.1f}",
                             f"{max(stop):.1f}", f"{args.stall_timeout + 60}"])
            on_cpu, on_wall = controller_cpu(cluster, shared, args.stall_timeout, args.steps)
            off_cpu, off_wall = controller_cpu(cluster, shared, 0, args.steps)
            reading_ms = progress_reading_cpu_ms(cluster, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    per_min = lambda cpu, wall: cpu / wall * 60 / 2  # noqa: E731 (2 hosts)
    cost = [["stall_timeout on", f"{on_wall:.1f}", f"{on_cpu:.2f}", f"{per_min(on_cpu, on_wall):.3f}"],
            ["stall_timeout 0 (off)", f"{off_wall:.1f}", f"{off_cpu:.2f}", f"{per_min(off_cpu, off_wall):.3f}"],
            ["the watchdog (on - off)", "", f"{on_cpu - off_cpu:.2f}",
             f"{per_min(on_cpu, on_wall) - per_min(off_cpu, off_wall):.3f}"]]
    md = ["## Stalls (issue 20)", "",
          f"2 containerized hosts x 2 ranks, gloo, `stall_timeout: {args.stall_timeout}`. Seconds from the hang "
          "(rank 3 deadlocked in a Python function; rank 1 stopped by SIGSTOP) until ftbundle named the odd one "
          "out, and until it had exited with no process of the job left on any host.", "",
          table(["hang", "trials", "diagnosed median s", "worst s", "all stopped median s", "worst s",
                 "limit s (stall_timeout + 60)"], rows), "",
          f"What the watchdog costs the controller: ftbundle's own CPU over a healthy run of {args.steps} steps "
          "with the watchdog on and off (the difference is the watchdog's; per host and minute of run):", "",
          table(["run", "wall s", "ftbundle CPU s", "CPU s per host-minute"], cost), "",
          "(one run each: the difference is within a shared machine's noise; it bounds the cost, it does not "
          "pin it down)", "",
          f"On each node, one progress reading (one `stat` of every rank's output files, with each heartbeat, "
          f"once a second) costs {reading_ms:.2f} ms of CPU."]
    write_section("stall", "\n".join(md))


if __name__ == "__main__":
    main()
