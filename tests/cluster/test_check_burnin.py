"""`ftbundle check --burn-in`: every host loaded at once and compared with the fleet's median.

The comparison (a pure function) and the burn-in on this machine alone are in
tests/unit/test_check_burnin_unit.py; here the burn-in runs on three containerized hosts,
healthy and then with one host's CPU capped by its cgroup (`docker update --cpus 0.3`): that
host, and no other, is named slow. The GPU half (bf16 GEMM, HBM copy) runs in tests/gpu/test_gpu.py
where a GPU is lent.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.support.helpers import base_job, ftbundle, write_job

# ---------------------------------------------------------------------------------------
# for real: three containerized hosts, one of them capped

SLOW_LINE = re.compile(r"^warning: (\S+) is slow: CPU GEMM ([0-9.]+) GFLOP/s, ([0-9.]+)x the fleet's median "
                       r"([0-9.]+) GFLOP/s, ([0-9.]+)x in its fastest slice$", re.M)


def burn_in(job_path, seconds: int = 5, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`ftbundle check JOB --burn-in SECONDS [EXTRA...]`, and the burnin.json it kept."""
    proc = ftbundle("check", str(job_path), "--burn-in", str(seconds), *extra, timeout=240)
    kept = re.search(r"figures in (\S+/burnin\.json)$", proc.stdout, re.M)
    assert kept, proc.stdout + proc.stderr
    with open(kept.group(1)) as f:
        return proc, json.load(f)


def throttled_s(container: str) -> float:
    """Seconds the container's CPU quota has held it back so far (cgroup v1 cpu.stat)."""
    cid = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", container], capture_output=True, text=True,
                         check=True).stdout.strip()
    for base in (f"/sys/fs/cgroup/cpu/docker/{cid}", f"/sys/fs/cgroup/cpu,cpuacct/docker/{cid}"):
        try:
            stat = dict(line.split() for line in open(f"{base}/cpu.stat"))
            return int(stat["throttled_time"]) / 1e9
        except OSError:
            continue
    return float("nan")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_burn_in_names_the_host_whose_cpu_is_capped_and_no_healthy_host(make_cluster, tmp_path):
    """node2's CPU capped at 0.3 of a core (its cgroup's CFS quota): the burn-in names node2
    slow, with its figure and the median, and never a healthy host; uncapped, nobody.

    This machine has 2 cores for the three hosts' loads and make test's other workers, and
    (cgroup v1) all containers together weigh as much as one busy process outside them: a
    healthy host gets a share of a core that moves with the machine's load (measured: 0.9 down
    to 0.15 of a core, 90 to 15 GFLOP/s) and the hosts' figures differ by up to 13% when it is
    busiest. When a healthy host gets no more than 0.3 of a core itself, a 0.3 cap holds node2
    back not at all (seen: node2 throttled 0.04 s of 5, all three at 15.5-17.3 GFLOP/s), and
    the three are a healthy fleet in all but name. So each part is made again when the
    machine defeated it: the healthy fleet twice at most (nobody named in one of them), and
    the capped one at 0.3, then 0.1, then 0.05 of a core, until node2 alone is named. Another
    host named while the cap held node2 back (throttled a second or more) fails the test at
    once. What each try measured is printed."""
    cluster = make_cluster(3)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job_path = write_job(tmp_path / "job.yaml", base_job("burn", cluster.shared_dir, inventory, {"command": "true"}))

    def figures(kept: dict) -> dict:
        return {f["host"]: round(f["value"], 1) for f in kept["figures"]}

    tries = []
    for _ in range(2):
        started = time.monotonic()
        proc, healthy = burn_in(job_path, 5, "--net", "--min-gbps", "0.1")  # --net's figures kept beside
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(f["host"] for f in healthy["figures"]) == ["node0", "node1", "node2"], proc.stdout
        tries.append(f"healthy {figures(healthy)} ({took:.1f}s, load {open('/proc/loadavg').read().split()[0]})")
        if not healthy["slow"]:
            break
    assert not healthy["slow"], "a healthy fleet had a host named slow: " + "; ".join(tries)
    assert "no host is slow" in proc.stdout and not SLOW_LINE.search(proc.stdout), proc.stdout
    assert "CPU GEMM    median " in proc.stdout and "node[0-2]: " in proc.stdout, proc.stdout
    assert sorted(healthy["net"]["throughput_gbps"]) == ["node1", "node2"] and healthy["net"]["busbw_gbps"] > 0
    assert proc.stdout.index("network check done") < proc.stdout.index("ftbundle check --burn-in")

    capped = cluster.host("node2").container
    for cap in ("0.3", "0.1", "0.05"):
        before = throttled_s(capped)
        subprocess.run(["docker", "update", "--cpus", cap, capped], check=True, capture_output=True)
        try:
            proc, slowed = burn_in(job_path)
        finally:
            subprocess.run(["docker", "update", "--cpu-quota", "-1", capped], check=True, capture_output=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr  # slow is a warning, not a failure
        named = SLOW_LINE.findall(proc.stdout)
        tries.append(f"node2 at --cpus {cap}: {figures(slowed)}, node2 throttled {throttled_s(capped) - before:.1f}s, "
                     f"load {open('/proc/loadavg').read().split()[0]}, named {[n[0] for n in named]}, node2's "
                     f"slices {[round(v, 1) for v in slowed['nodes']['node2']['devices'][0]['cpu_gemm_gflops_slices']]}")
        if named:
            assert [n[0] for n in named] == ["node2"] or throttled_s(capped) - before < 1, proc.stdout
        if [n[0] for n in named] == ["node2"]:
            break
    assert [n[0] for n in named] == ["node2"], "node2 (capped) never named alone: " + "; ".join(tries)
    assert [s["host"] for s in slowed["slow"]] == ["node2"]
    assert float(named[0][1]) == pytest.approx(slowed["slow"][0]["value"], rel=0.01)  # printed to 3 digits
    assert float(named[0][3]) == pytest.approx(slowed["medians"]["cpu_gemm_gflops"], rel=0.01)  # 3 digits
    assert "node[0-1]: " in proc.stdout, proc.stdout  # the healthy ones, folded
    print("burn-in 5 s on 3 hosts: " + "; ".join(tries) + f"; node2 named at {slowed['slow'][0]['ratio']:.2f}x "
          "the median")


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_host_whose_load_dies_is_named_not_measured_and_nothing_is_left(make_cluster, tmp_path):
    """node1's burn-in killed (SIGKILL) while it measures: the check exits 2 naming node1 as
    not measured, says the others were stopped with it rather than slow, and leaves no load
    running on any host."""
    from tests.support.helpers import start_ftbundle
    from tests.cluster.test_check import leftovers

    cluster = make_cluster(3)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job_path = write_job(tmp_path / "job.yaml", base_job("burn", cluster.shared_dir, inventory, {"command": "true"}))
    proc = start_ftbundle("check", str(job_path), "--burn-in", "30")
    deadline = time.monotonic() + 120
    while not cluster.pgrep("node1", "ftb_burnin") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.pgrep("node1", "ftb_burnin"), "node1's burn-in never started"
    time.sleep(2)
    load = [line.split()[0] for line in cluster.pgrep("node1", "ftb_burnin")
            if line.split()[1].rsplit("/", 1)[-1].startswith("python")]  # not the node program's shell
    assert load, cluster.pgrep("node1", "ftb_burnin")
    cluster.exec("node1", f"kill -KILL {' '.join(load)}")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert any(e.startswith("error: node1: not measured: ") for e in errors), out
    assert {e.split(":")[1].strip() for e in errors} == {"node0", "node1", "node2"}, out
    assert all("stopped when node1 failed" in e for e in errors if not e.startswith("error: node1:")), out
    assert "is slow" not in out and "burn-in incomplete" in out, out
    assert leftovers(cluster) == {}
    print("\n".join(errors))
