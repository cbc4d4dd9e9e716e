"""The containerized test cluster itself: SSH, shared dir, venv, partition, kill, cleanup."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest


def _docker_names(kind: str, prefix: str) -> list[str]:
    args = (
        ["docker", "ps", "-a"] if kind == "container" else ["docker", "network", "ls"]
    )
    out = subprocess.run(
        args + ["--format", "{{.Name}}" if kind == "network" else "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [n for n in out if n.startswith(prefix)]


def _tcp_22(cluster, src, dst) -> subprocess.CompletedProcess:
    return cluster.exec(src, f"timeout 3 bash -c '</dev/tcp/{dst.ip}/22'", check=False)


@pytest.mark.cluster
def test_cluster_in_a_box(make_cluster):
    c = make_cluster(3)
    node0, node1, node2 = c.hosts
    assert len(_docker_names("container", c.name)) == 3
    assert _docker_names("network", c.name) == [f"{c.name}-net"]

    # SSH from the controller, with the cluster's key and known_hosts only
    names = []
    for h in c.hosts:
        p = subprocess.run(
            c.ssh_argv(h) + ["hostname"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert p.returncode == 0, p.stderr
        names.append(p.stdout.strip())
    assert names == ["node0", "node1", "node2"]
    assert "BatchMode=yes" in c.ssh_argv(node0)

    # shared_dir: same path everywhere, read-write
    token = uuid.uuid4().hex
    c.exec(node0, f"echo {token} > {c.shared_dir}/from-node0")
    assert c.exec(node2, f"cat {c.shared_dir}/from-node0").stdout.strip() == token
    assert (c.shared_dir / "from-node0").read_text().strip() == token

    # the controller's venv runs on the hosts
    if sys.prefix != sys.base_prefix:
        p = c.exec(
            node1,
            f"cd / && {sys.executable} -c 'import sys, yaml, torch; print(sys.prefix)'",
            check=False,
        )
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == sys.prefix

    # hosts reach each other by name, on port 22
    assert _tcp_22(c, node0, node1).returncode == 0
    assert c.exec(node0, "getent hosts node1").stdout.split()[0] == node1.ip

    # a network partition cuts node1 off; heal restores it
    c.partition(node1)
    t0 = time.monotonic()
    assert _tcp_22(c, node0, node1).returncode != 0
    assert time.monotonic() - t0 < 10
    c.heal(node1)
    assert _tcp_22(c, node0, node1).returncode == 0

    # pgrep sees sshd (and never itself)
    procs = c.pgrep(node1, "sshd")
    assert procs and all("pgrep" not in p for p in procs)

    # a node dies
    c.kill(node2)
    assert not c.is_running(node2)
    assert _tcp_22(c, node0, node2).returncode != 0

    # inventory for Ansible
    inv = c.write_inventory(c.tmpdir / "inventory.yml")
    assert "node0" in inv.read_text() and node0.ip in inv.read_text()

    name, tmpdir = c.name, c.tmpdir
    c.down()
    c.down()  # idempotent
    assert _docker_names("container", name) == []
    assert _docker_names("network", name) == []
    assert not tmpdir.exists()
