"""site.yml on hosts with systemd as PID 1: Molecule's "systemd" scenario.

Two containerized hosts boot systemd (cgroup v1, .ci/testhost-systemd-image.sh) with
docker.service, ssh.service and Debian's nftables.service running. In order: `--check
--diff` on these fresh hosts (passes and changes nothing, although ftbundle's units do
not exist yet), converge, a second converge with changed=0, then verify.yml (the units
enabled and active, no rollback timer left, our table back after a restart and a reload of
nftables.service). The image and verify roles are skipped (--skip-tags image,verify):
the default and lived-in scenarios cover them, and pulling costs minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.test_provisioning import BIN, TESTBED, recap, run, tail

# this checkout's names and subnet for the scenario (tests/testbed.py; slot 0: ftb-sd-node0..1, 198.18.251.0/24)
SCENARIO = TESTBED.systemd
HOSTS = SCENARIO.hosts[:2]
NETWORK = SCENARIO.network
SKIP = ["--skip-tags", "image,verify"]


def docker_exec(host: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "exec", host, "bash", "-c", command], capture_output=True, text=True,
                          timeout=300)


def remove_debris() -> None:
    subprocess.run(["docker", "rm", "-f", "-v", *HOSTS], capture_output=True, timeout=300)
    subprocess.run(["docker", "network", "rm", NETWORK], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def scenario(testhost_image):
    built = run(["bash", ".ci/testhost-systemd-image.sh"], timeout=1200)
    assert built.returncode == 0, tail(built)
    workdir = Path(tempfile.mkdtemp(prefix="ftb-systemd-", dir="/tmp"))
    env = dict(os.environ, FTB_TESTHOST_SYSTEMD_IMAGE=built.stdout.strip().splitlines()[-1],
               FTB_SYSTEMD_WORKDIR=str(workdir), PATH=f"{BIN}:{os.environ['PATH']}",
               ANSIBLE_FORCE_COLOR="0", PY_COLORS="0", **TESTBED.molecule_env(SCENARIO, workdir / "state"))

    def molecule(command: str, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
        return run([str(BIN / "molecule"), command, "-s", "systemd", *args], env=env, timeout=timeout)

    remove_debris()
    molecule("destroy", timeout=300)
    try:
        for step in ("create", "prepare"):
            proc = molecule(step)
            assert proc.returncode == 0, tail(proc, 12000)
        yield molecule
    finally:
        remove_debris()
        molecule("destroy", timeout=300)
        shutil.rmtree(workdir, ignore_errors=True)


def state(host: str) -> str:
    proc = docker_exec(host, "ls /etc/ftbundle /etc/systemd/system/ftbundle-firewall.service 2>&1; "
                             "nft list tables; systemctl list-units --all 'ftbundle*' --no-legend; cat /etc/fstab")
    return proc.stdout


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_check_converge_idempotence_verify_on_hosts_with_systemd(scenario):
    for host in HOSTS:
        assert docker_exec(host, "cat /proc/1/comm").stdout.strip() == "systemd"
    before = {host: state(host) for host in HOSTS}
    started = time.monotonic()
    check = scenario("converge", "--", "--check", "--diff", *SKIP)
    print(f"--check --diff on 2 fresh systemd hosts: {time.monotonic() - started:.0f}s")
    assert check.returncode == 0, tail(check, 12000)
    assert {host: state(host) for host in HOSTS} == before
    assert "table inet ftbundle" not in before[HOSTS[0]]

    started = time.monotonic()
    proc = scenario("converge", "--", *SKIP)
    print(f"converge on 2 systemd hosts: {time.monotonic() - started:.0f}s")
    assert proc.returncode == 0, tail(proc, 12000)

    again = scenario("converge", "--", *SKIP)
    assert again.returncode == 0, tail(again, 12000)
    hosts = recap(again.stdout)
    assert sorted(hosts) == HOSTS and all(h["changed"] == 0 for h in hosts.values()), again.stdout[-3000:]

    check = scenario("converge", "--", "--check", "--diff", *SKIP)  # on configured hosts
    assert check.returncode == 0, tail(check, 12000)
    assert all(h["changed"] == 0 for h in recap(check.stdout).values()), check.stdout[-3000:]

    verified = scenario("verify")
    assert verified.returncode == 0, tail(verified, 12000)
