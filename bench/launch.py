"""Benchmark: start latency, from invocation until every host's command runs.

On 1, 2, 4, 8 and 16 containerized hosts (one cluster of 16; the first N hosts), the same
trivial command is started by:

* pdsh (Debian's, ssh module, fan-out 32),
* a parallel ssh loop (`for h in ...; do ssh h CMD & done; wait`),
* `ftbundle run --no-check` (check off) and `ftbundle run` (the check first),

with the same key and known_hosts. The command writes the host clock's time (the containers
share the controller's clock) into a file on the shared directory; start latency is the
latest of those minus the moment the tool was invoked. For ftbundle it also records its
CPU seconds per host, its peak RSS and the SSH logins sshd accepted per run. Median of
--runs runs after one warm-up each (which also fills ftbundle's inventory cache).

    .venv/bin/python bench/launch.py [--sizes 1,2,4,8,16] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, measure, median, table, write_section

from tests.cluster import Cluster, ensure_image
from tests.helpers import base_job, logins, write_job


def stamp_cmd(shared: Path, tag: str) -> str:
    return f"date +%s.%N > {shared}/ts/{tag}-$(hostname)"


def latency(shared: Path, tag: str, started_wall: float, n: int) -> float:
    files = list((shared / "ts").glob(f"{tag}-*"))
    if len(files) != n:
        raise RuntimeError(f"{tag}: {len(files)} of {n} hosts ran the command")
    return max(float(f.read_text()) for f in files) - started_wall


def ssh_opts(cluster: Cluster) -> list[str]:
    return ["-i", str(cluster.key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR"]


def run_tool(tool: str, cluster: Cluster, hosts, shared: Path, job_dir: Path, tag: str):
    """One run; (latency s, measurement or None)."""
    n = len(hosts)
    ips = [h.ip for h in hosts]
    env = dict(os.environ)
    wall = time.time()
    if tool == "pdsh":
        env["PDSH_SSH_ARGS_APPEND"] = " ".join(ssh_opts(cluster))
        env["PDSH_RCMD_TYPE"] = "ssh"
        m = measure(["pdsh", "-f", "32", "-l", "root", "-w", ",".join(ips), stamp_cmd(shared, tag)], env=env)
    elif tool == "ssh loop":
        opts = " ".join(ssh_opts(cluster))
        loop = f"for h in {' '.join(ips)}; do ssh {opts} root@$h '{stamp_cmd(shared, tag)}' & done; wait"
        m = measure(["bash", "-c", loop], env=env)
    else:
        inventory = job_dir / f"hosts{n}.yml"
        if not inventory.exists():
            cluster_inventory(cluster, hosts, inventory)
        job = write_job(job_dir / f"{tag}.yaml", base_job("latency", shared, inventory,
                                                          {"command": stamp_cmd(shared, tag)}))
        argv = [sys.executable, "-m", "ftbundle", "run", "-v", str(job)] + (["--no-check"] if tool.endswith("off") else [])
        wall = time.time()
        m = measure(argv, env=env)
    if m.code != 0:
        raise RuntimeError(f"{tool} failed ({m.code}): {m.stderr.decode()[-2000:]}")
    return latency(shared, tag, wall, n), m


def cluster_inventory(cluster: Cluster, hosts, path: Path) -> None:
    names = {h.name for h in hosts}
    full = cluster.write_inventory(path)
    import yaml
    inv = yaml.safe_load(full.read_text())
    group = inv["all"]["children"]["trainers"]["hosts"]
    inv["all"]["children"]["trainers"]["hosts"] = {k: v for k, v in group.items() if k in names}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not shutil.which("pdsh"):
        raise SystemExit("pdsh is not installed (make bench installs it: apt-get install pdsh)")
    ensure_image()
    # ftbundle as pip installs it, with its bytecode compiled: an editable checkout under
    # PYTHONDONTWRITEBYTECODE (set on some CI machines) would otherwise compile every module
    # of ftbundle on every start, about 70 ms that no user pays.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "ftbundle")], check=True,
                   stdout=subprocess.DEVNULL)
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-launch-", dir="/tmp"))
    job_dir = Path(tempfile.mkdtemp(prefix="ftb-bench-jobs-"))
    (shared / "ts").mkdir()
    tools = ["pdsh", "ssh loop", "ftbundle check off", "ftbundle check on"]
    rows, detail, raw = [], [], {}
    try:
        with Cluster(max(sizes), shared_dir=shared) as cluster:
            for n in sizes:
                hosts = cluster.hosts[:n]
                results: dict[str, list] = {t: [] for t in tools}
                for i in range(args.runs + 1):
                    for tool in tools:  # interleaved, so drift hits every tool alike
                        tag = f"{tool.replace(' ', '_')}-{n}-{i}"
                        before = logins(cluster)
                        lat, m = run_tool(tool, cluster, hosts, shared, job_dir, tag)
                        if i:  # run 0 warms up (page cache, ftbundle's inventory cache)
                            results[tool].append((lat, m, logins(cluster) - before))
                med = {t: median([r[0] for r in results[t]]) for t in tools}
                off, on = results["ftbundle check off"], results["ftbundle check on"]
                rows.append([n] + [f"{med[t]:.2f}" for t in tools] + [
                    f"{med['ftbundle check off'] / med['pdsh']:.2f}x", f"{med['ftbundle check on'] / med['pdsh']:.2f}x",
                    f"{med['ftbundle check off'] / med['ssh loop']:.2f}x"])
                detail.append([n, f"{median([m.cpu_s for _, m, _ in off]) / n:.3f}",
                               f"{median([m.cpu_s for _, m, _ in on]) / n:.3f}",
                               f"{max(m.maxrss_mb for _, m, _ in on):.0f}",
                               f"{median([k for _, _, k in off]):.0f} / {median([k for _, _, k in on]):.0f}",
                               f"{median([m.wall_s for _, m, _ in off]):.2f}"])
                raw[n] = {"off": med["ftbundle check off"], "on": med["ftbundle check on"], "pdsh": med["pdsh"],
                          "rss": max(m.maxrss_mb for _, m, _ in on),
                          "cpu_on": median([m.cpu_s for _, m, _ in on]) / n}
                print(rows[-1], detail[-1], flush=True)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(job_dir, ignore_errors=True)
    md = ["## Start latency (issue 9)", "",
          f"From invocation until every host's command runs; median of {args.runs} runs after a warm-up, "
          "tools interleaved in one session on one cluster of containerized sshd hosts. Seconds.", "",
          table(["hosts", "pdsh", "ssh loop", "ftbundle check off", "ftbundle check on",
                 "off / pdsh", "on / pdsh", "off / ssh loop"], rows), "",
          "ftbundle's own cost (the `ftbundle run` process; the job is `date`):", "",
          table(["hosts", "CPU s per host, check off", "CPU s per host, check on", "peak RSS MB (check on)",
                 "SSH logins per run (off / on)", "whole run wall s, check off"], detail)]
    md += ["", fixed_cost(raw), "", estimate(raw)]
    write_section("launch", "\n".join(md))


def fixed_cost(raw: dict, runs: int = 7) -> str:
    """What ftbundle pays before any network, measured here (median of ``runs``): the
    interpreter's start (wall time of `python -c pass`), then, timed inside one process,
    importing Fabric with paramiko and what a check-off start imports of ftbundle (the check's
    modules come only with the check)."""
    probe = ("import time; t0 = time.perf_counter(); import fabric; t1 = time.perf_counter(); "
             "import ftbundle.cli, ftbundle.launch, ftbundle.ui; "
             "print(t1 - t0, time.perf_counter() - t1)")
    starts, fabric, own = [], [], []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, cwd=REPO)
        starts.append(time.perf_counter() - began)
        a, b = subprocess.run([sys.executable, "-c", probe], check=True, cwd=REPO, capture_output=True,
                              text=True).stdout.split()
        fabric.append(float(a))
        own.append(float(b))
    rows = [["the interpreter starts (`python -c pass`, wall)", f"{median(starts):.3f}"],
            ["import Fabric and paramiko", f"{median(fabric):.3f}"],
            ["import ftbundle's launch path, check off (after them)", f"{median(own):.3f}"],
            ["sum", f"{median(starts) + median(fabric) + median(own):.3f}"]]
    one = raw.get(1)
    tail = (f" At 1 host the whole start took {one['off']:.2f} s with the check off, pdsh {one['pdsh']:.2f} s."
            if one else "")
    return "\n".join([
        f"Where the fixed cost goes: ftbundle's Python before it can send a byte (median of {runs}, seconds; "
        "the TCP connections are made meanwhile, the SSH handshakes need paramiko). pdsh and ssh are C and pay "
        "almost none of it. It does not grow with the number of hosts, so it weighs most at 1-2 hosts, where the "
        "whole start is a few tenths of a second." + tail, "",
        table(["step", "s"], rows)])


def estimate(raw: dict) -> str:
    """64 and 256 hosts, extrapolated linearly from the two largest sizes measured."""
    sizes = sorted(raw)
    if len(sizes) < 2:
        return ""
    a, b = sizes[-2], sizes[-1]
    rows = []
    for n in (64, 256):
        def line(key):
            slope = (raw[b][key] - raw[a][key]) / (b - a)
            return raw[b][key] + slope * (n - b)
        rows.append([n, f"{line('off'):.1f}", f"{line('on'):.1f}", f"{line('pdsh'):.1f}", f"{line('rss'):.0f}",
                     f"{raw[b]['cpu_on'] * n:.1f}"])
    return "\n".join([
        f"**Estimate, not measured**: 64 and 256 hosts, extrapolated linearly from {a} and {b} hosts.", "",
        table(["hosts", "start s, check off", "start s, check on", "pdsh s", "peak RSS MB",
               "controller CPU s (check on)"], rows), "",
        "What limits each figure: on these 2 cores the controller's CPU (paramiko's handshake is Python around "
        "C crypto; the check's probe parsing) and the containers' own sshd and python3 share the same cores, so "
        "the slope is steeper here than against real hosts, whose work runs on their own CPUs. At 256 hosts the "
        "controller holds 256 SSH transports (one paramiko thread each) plus one reader thread per node channel "
        "(about 520 threads); memory grows by the transports' buffers. pdsh forks 32 ssh at a time (fan-out), "
        "so its slope is per batch of 32."])


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
