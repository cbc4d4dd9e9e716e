"""Benchmark: what reading the GPUs during a run costs (issue 47 item 5).

On N containerized hosts whose nvidia-smi is the stand-in replaying 8 busy H100s (the sampler's
`-lms` loop; tests/assets/nvidia-smi-replay), one `command: sleep S` job runs in pairs,
alternating: ``gpus_per_node: 0`` (a CPU job: nothing read) and the default (every node reads
its 8 GPUs every 2 s and sends one `ftb-smi` line on its control channel). Reported:

* the launcher: its CPU seconds (wait4, its threads included) for each, and the difference per
  node-hour of run;
* the node: the node program's own CPU on one host (every process of it: the heartbeat, the
  watchdog and, with GPUs, the loop that joins each reading's lines; /proc utime+stime read a
  moment before its job ends), with and without the GPUs, per hour. The stand-in's own CPU
  (awk and sleep standing in for nvidia-smi) is not counted: it is not the driver's.

    .venv/bin/python bench/gpu_metrics.py [--sizes 16,128] [--seconds 90] [--pairs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import HOST_PYTHON, measure, table, write_section

from tests.support.cluster import Cluster, ensure_image
from tests.support.helpers import SMI, base_job, install_smi, write_job

WARM_S = 15  # every node up and reading before the steady part is measured
# the CPU ticks of every process of the node program on a host (its processes' command lines end
# "ftb node sleep S"; the job itself is `sleep`, not counted), printed as seconds
NODE_CPU = r"""
import os
tick, total = os.sysconf("SC_CLK_TCK"), 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if b"ftb" in args and b"node" in args and args[0].endswith(b"bash"):
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    except OSError:
        pass
print(total / tick)
"""


def hosts_inventory(cluster: Cluster, n: int, path: Path) -> Path:
    import yaml

    inventory = cluster.write_inventory(path)
    inv = yaml.safe_load(inventory.read_text())
    group = inv["all"]["children"]["trainers"]["hosts"]
    keep = {h.name for h in cluster.hosts[:n]}
    inv["all"]["children"]["trainers"]["hosts"] = {k: v for k, v in group.items() if k in keep}
    inventory.write_text(yaml.safe_dump(inv, sort_keys=False))
    return inventory


def one(cluster: Cluster, job: Path, seconds: float) -> tuple[float, float, list[str]]:
    """One run: (the launcher's CPU s/h, the node program's CPU s/h on node0, what it named of the
    GPUs), the CPU over the run's steady part, from WARM_S after its start to 2 s before its job
    ends (its start-up, imports and connections, is the same with or without GPUs and much larger
    than what is measured). The fleet is healthy and busy: anything named is a false alarm."""
    found: dict[str, float] = {}

    def node_cpu() -> float:
        return float(cluster.exec("node0", f"{HOST_PYTHON} -c '{NODE_CPU}'").stdout.strip() or 0)

    def own_cpu(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def read(proc) -> None:
        def later() -> None:
            time.sleep(WARM_S)
            t0, l0, n0 = time.monotonic(), own_cpu(proc.pid), node_cpu()
            time.sleep(seconds - WARM_S - 2)
            t1, l1, n1 = time.monotonic(), own_cpu(proc.pid), node_cpu()
            found.update(launcher=(l1 - l0) * 3600 / (t1 - t0), node=(n1 - n0) * 3600 / (t1 - t0))
        threading.Thread(target=later, daemon=True).start()

    m = measure([sys.executable, "-m", "ftbundle", "run", "--no-check", str(job)], on_start=read)
    if m.code != 0 or "launcher" not in found:
        raise RuntimeError(f"run failed ({m.code}): {m.stderr.decode()[-2000:]}")
    named = [line for line in m.stderr.decode(errors="replace").splitlines()
             if line.startswith("ftbundle: warning: ") and any(said in line for said in GPU_VERDICTS)]
    return found["launcher"], found["node"], named


# what gpu_metrics names of a node or GPU (its warnings' words)
GPU_VERDICTS = ("GPU readings stopped", "has sent no GPU reading", "idle well below", "out-of-memory risk",
                "is throttled")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="16,128")
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ensure_image()
    tmp = Path(tempfile.mkdtemp(prefix="ftb-bench-gpus-", dir="/tmp"))
    shared = tmp / "shared"
    shared.mkdir()
    rows, started = [], time.monotonic()
    assert (SMI / "h100-x8.metrics.csv").exists()
    try:
        with Cluster(max(sizes), shared_dir=shared) as cluster:
            for host in cluster.hosts:
                install_smi(cluster, host.name, "h100-x8")
            for n in sizes:
                inventory = hosts_inventory(cluster, n, tmp / f"hosts{n}.yml")
                jobs = {
                    label: write_job(tmp / f"{label}{n}.yaml", base_job(
                        f"gpus-{label}", shared, inventory, {"command": f"sleep {args.seconds:g}"},
                        **({"gpus_per_node": 0} if label == "cpu" else {})))
                    for label in ("cpu", "gpu")}
                got: dict[str, list[tuple[float, float]]] = {"cpu": [], "gpu": []}
                named: list[str] = []
                for pair in range(args.pairs):
                    for label in ("cpu", "gpu"):
                        launcher_s, node_s, said = one(cluster, jobs[label], args.seconds)
                        got[label].append((launcher_s, node_s))
                        named += said
                        print(f"{n} hosts, {label}, pair {pair}: launcher {launcher_s:.1f} CPU s/h, "
                              f"node0's node program {node_s:.1f} CPU s/h, named {len(said)}", flush=True)
                        for line in said:
                            print(f"  false alarm: {line}", flush=True)
                    for old in (shared / "runs").glob("*"):
                        shutil.rmtree(old, ignore_errors=True)
                launcher = {k: statistics.median(c for c, _ in v) for k, v in got.items()}
                node = {k: statistics.median(c for _, c in v) for k, v in got.items()}
                rows.append([n, f"{launcher['cpu']:.1f}", f"{launcher['gpu']:.1f}",
                             f"{(launcher['gpu'] - launcher['cpu']) / n:.2f}",
                             f"{node['cpu']:.1f}", f"{node['gpu']:.1f}", f"{node['gpu'] - node['cpu']:.1f}",
                             str(len(named))])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    markdown = "\n".join([
        "## GPU readings during a run: their cost", "",
        f"A `command: sleep {args.seconds:g}` job on N containerized hosts whose nvidia-smi is the stand-in "
        "replaying 8 busy H100s, run in pairs alternating a CPU job (`gpus_per_node: 0`: nothing read) and the "
        "same job reading its GPUs every 2 s (one `nvidia-smi -lms` loop a node, one `ftb-smi` line a node on the "
        f"control channel). Median of {args.pairs} pair(s). CPU seconds per hour over each run's steady part "
        f"({WARM_S} s after its start to 2 s before its end): the launcher's own process (/proc, its threads "
        "included), and every process of the node program on node0 (heartbeat, watchdog, and with GPUs the loop "
        "joining each reading's lines); the stand-in's own CPU (awk standing "
        "in for nvidia-smi) is not counted. The chatty-node figure is its own benchmark's (chatty.py): the "
        "readings travel on the control channel, never on rank 0's log channel. The fleet is healthy and busy "
        "(every host replays the same busy readings) while these two cores run it all: `named` counts the "
        "warnings the GPU runs gave of a node or GPU (idle, near its memory, throttled, readings stopped) "
        "over all their pairs; each is a false alarm.", "",
        table(["hosts", "launcher CPU s/h, CPU job", "launcher CPU s/h, GPU job", "launcher CPU s per node-hour for the GPUs",
               "node program CPU s/h, CPU job", "node program CPU s/h, GPU job", "the GPU loop's CPU s/h on a node",
               "named (a healthy fleet)"],
              rows), "",
        f"_took {time.monotonic() - started:.0f} s_",
    ])
    write_section("gpu_metrics", markdown)


if __name__ == "__main__":
    main()
