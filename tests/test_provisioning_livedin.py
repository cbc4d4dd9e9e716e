"""site.yml on hosts that already have a life: Molecule's "lived-in" scenario.

Three containerized hosts (molecule/lived-in) come pre-seeded with an administrator's
state (prepare.yml): a known_hosts line, nccl.conf lines, an nftables table of their own,
a `Host *` block and an authorized key for a non-root training user, sshd on a second
port, a daemon.json already naming the registry, a running container, IPv6 on. In order:
`--check --diff` on these fresh hosts (passes, changes nothing, prints no key), converge,
verify.yml (all of that survived; SSH as the training user over IPv4 and IPv6), a second
converge with changed=0, and a `--limit` converge that keeps the cluster whole.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.test_provisioning import BIN, recap, run, tail

HOSTS = ["ftb-liv-node0", "ftb-liv-node1", "ftb-liv-node2"]
REGISTRY = "198.18.249.1:5000"  # the controller's registry, as these hosts reach it
NETWORK = "ftb-livedin"


def docker_exec(host: str, command: str) -> str:
    proc = subprocess.run(["docker", "exec", host, "bash", "-c", command], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{host}: {command}\n{tail(proc)}"
    return proc.stdout


class Scenario:
    def __init__(self, env: dict[str, str]):
        self.env = env

    def __call__(self, command: str, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
        return run([str(BIN / "molecule"), command, "-s", "lived-in", *args], env=self.env, timeout=timeout)


def remove_debris() -> None:
    subprocess.run(["docker", "rm", "-f", "-v", *HOSTS], capture_output=True, timeout=300)
    subprocess.run(["docker", "network", "rm", NETWORK], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def livedin(testhost_image):
    """The lived-in hosts, created and prepared (not yet converged); destroyed afterwards."""
    pushed = run(["bash", ".ci/registry.sh"], timeout=1200)
    assert pushed.returncode == 0, tail(pushed)
    image = f"{REGISTRY}/{pushed.stdout.strip().splitlines()[-1]}"
    workdir = Path(tempfile.mkdtemp(prefix="ftb-livedin-", dir="/tmp"))
    (workdir / "shared").mkdir()
    env = dict(os.environ, FTB_TESTHOST_IMAGE=testhost_image, FTB_MOLECULE_IMAGE=image,
               FTB_LIVEDIN_WORKDIR=str(workdir), PATH=f"{BIN}:{os.environ['PATH']}",
               ANSIBLE_FORCE_COLOR="0", PY_COLORS="0")
    scenario = Scenario(env)
    scenario("destroy", timeout=300)
    remove_debris()
    try:
        for step in ("create", "prepare"):
            proc = scenario(step)
            assert proc.returncode == 0, tail(proc, 12000)
        yield scenario
    finally:
        scenario("destroy", timeout=300)
        remove_debris()
        shutil.rmtree(workdir, ignore_errors=True)


def snapshot(host: str) -> str:
    """The administrator's files and tables, and whether any of ftbundle's exist yet."""
    return docker_exec(host, "cat /etc/ssh/ssh_known_hosts /etc/nccl.conf /home/trainer/.ssh/config "
                             "/home/trainer/.ssh/authorized_keys /etc/docker/daemon.json /etc/fstab; "
                             "nft list tables; ls /etc/ftbundle 2>&1; docker ps --format '{{.Names}}'")


@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_check_diff_on_fresh_hosts_passes_and_changes_nothing(livedin):
    before = {host: snapshot(host) for host in HOSTS}
    proc = livedin("converge", "--", "--check", "--diff")
    assert proc.returncode == 0, tail(proc, 12000)
    assert "PRIVATE KEY" not in proc.stdout + proc.stderr
    assert "--check: the cluster keypair does not exist yet" in proc.stdout, tail(proc, 12000)
    assert "a real run pulls it" in proc.stdout, tail(proc, 12000)
    assert {host: snapshot(host) for host in HOSTS} == before
    assert "table inet ftbundle" not in before[HOSTS[0]]


@pytest.mark.cluster
@pytest.mark.timeout(1500)
def test_converge_keeps_the_administrators_state(livedin):
    started = time.monotonic()
    proc = livedin("converge")
    print(f"converge of site.yml on 3 lived-in hosts: {time.monotonic() - started:.0f}s")
    assert proc.returncode == 0, tail(proc, 12000)
    assert all(h["failed"] == 0 for h in recap(proc.stdout).values()), proc.stdout[-3000:]
    verified = livedin("verify")  # molecule/lived-in/verify.yml
    assert verified.returncode == 0, tail(verified, 12000)
    assert all(h["failed"] == 0 for h in recap(verified.stdout).values()), verified.stdout[-3000:]


@pytest.mark.cluster
@pytest.mark.timeout(1500)
def test_second_converge_changes_nothing(livedin):
    proc = livedin("idempotence")
    assert proc.returncode == 0, tail(proc, 12000)
    hosts = recap(proc.stdout)
    assert sorted(hosts) == HOSTS and all(h["changed"] == 0 for h in hosts.values()), proc.stdout[-3000:]


@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_a_limit_converge_keeps_the_cluster_whole(livedin):
    """`--limit` one node: its known_hosts and firewall set are exactly what a full run
    wrote (changed=0), so every trainer and every member address is still there."""
    proc = livedin("converge", "--", "--limit", HOSTS[1])
    assert proc.returncode == 0, tail(proc, 12000)
    hosts = recap(proc.stdout)
    assert list(hosts) == [HOSTS[1]] and hosts[HOSTS[1]]["changed"] == 0, proc.stdout[-3000:]
    known = docker_exec(HOSTS[1], "cat /etc/ssh/ssh_known_hosts")
    rules = docker_exec(HOSTS[1], "nft list table inet ftbundle")
    for i, host in enumerate(HOSTS):
        assert host in known and f"fd00:f7b:0:249::1{i + 1}" in known, known
        assert f"198.18.249.1{i + 1}" in rules and f"fd00:f7b:0:249::1{i + 1}" in rules, rules
    assert "bastion.example.com" in known
    verified = livedin("verify")
    assert verified.returncode == 0, tail(verified, 12000)
