"""site.yml's preflight on real hosts, over SSH: what it refuses before anything changes.

Two plain containerized hosts (tests/support/cluster.py: random names and subnet, no Docker
engine inside). Only preflight runs (`--tags preflight`): it reads the inventory and each
host's distribution, and changes nothing.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import Cluster
from tests.cluster.test_provisioning import BIN, recap, run, tail

DIGEST_REF = "198.18.0.1:5000/ftbundle/none@sha256:" + "0" * 64
ROCKY_OS_RELEASE = """NAME="Rocky Linux"
VERSION="9.3 (Blue Onyx)"
ID="rocky"
ID_LIKE="rhel centos fedora"
VERSION_ID="9.3"
PLATFORM_ID="platform:el9"
PRETTY_NAME="Rocky Linux 9.3 (Blue Onyx)"
"""


@pytest.fixture(scope="module")
def hosts(testhost_image):
    work = Path(tempfile.mkdtemp(prefix="ftb-preflight-", dir="/tmp"))
    try:
        with Cluster(2, name_prefix="ftb-pref", shared_dir=work / "shared", image=testhost_image) as cluster:
            yield cluster, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def inventory(cluster: Cluster, path: Path, *, nfs_server: bool, extra: dict | None = None) -> Path:
    """Both hosts trainers; node0 the NFS server when nfs_server."""
    common = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(cluster.key_file),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={cluster.known_hosts} -o StrictHostKeyChecking=yes",
        "ansible_python_interpreter": "/usr/bin/python3",
        "ftb_image": DIGEST_REF, "ftb_shared_dir": "/shared", "ftb_training_user": "root",
        **(extra or {}),
    }
    children = {"trainers": {"hosts": {h.name: {"ansible_host": h.ip} for h in cluster.hosts}}}
    if nfs_server:
        children["nfs_server"] = {"hosts": {cluster.hosts[0].name: {}}}
    path.write_text(yaml.safe_dump({"all": {"vars": common, "children": children}}, sort_keys=False))
    return path


def preflight(inv: Path, *args: str):
    env_argv = [str(BIN / "ansible-playbook"), "site.yml", "-i", str(inv), "--tags", "preflight", *args]
    return run(env_argv, timeout=300)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_no_nfs_server_group_and_no_external_server_is_refused_naming_both(hosts):
    cluster, work = hosts
    proc = preflight(inventory(cluster, work / "none.yml", nfs_server=False))
    assert proc.returncode != 0, tail(proc)
    out = proc.stdout
    assert "no NFS server for the shared storage" in out, tail(proc)
    assert "Put one host in group 'nfs_server'" in out and "set nfs_client_server" in out, tail(proc)


LISTEN_2049 = ("setsid nohup python3 -c 'import socket, time; s = socket.socket(); "
               "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"0.0.0.0\", 2049)); s.listen(8); "
               "time.sleep(600)' ftb-fake-nfsd >/dev/null 2>&1 </dev/null &")


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_an_external_nfs_server_passes_preflight(hosts):
    """An external server that answers on TCP 2049 (a listener on node0 stands in for the filer's
    nfsd: the preflight asks only that its port answers)."""
    cluster, work = hosts
    filer = cluster.hosts[0]
    cluster.exec(filer, LISTEN_2049)
    inv = inventory(cluster, work / "external.yml", nfs_server=False,
                    extra={"nfs_client_server": filer.ip, "nfs_client_export": "/vol/ml"})
    # (these hosts run no Docker engine: the checks of what the docker and image roles need are
    # skipped with them; tests/cluster/test_day_zero.py walks into each)
    try:
        proc = preflight(inv, "--skip-tags", "docker,image")
    finally:
        cluster.exec(filer, "pkill -f [f]tb-fake-nfsd || true")  # ([f]: not this shell itself)
    assert proc.returncode == 0, tail(proc)
    assert "Preflight | The NFS server site.yml does not start answers" in proc.stdout
    hosts_recap = recap(proc.stdout)
    assert sorted(hosts_recap) == sorted(h.name for h in cluster.hosts), proc.stdout[-3000:]
    assert all(h["failed"] == 0 and h["changed"] == 0 for h in hosts_recap.values()), proc.stdout[-3000:]
    # the checks really ran (and read each host's distribution), they were not skipped
    assert "Preflight | Shared storage has a server" in proc.stdout
    assert "Preflight | A supported distribution" in proc.stdout


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_another_distribution_is_refused_with_a_clear_message(hosts):
    """node1 reports Rocky Linux 9.3 (its /etc/os-release, as a Rocky host has it): the
    run stops in preflight, on every host, naming node1 and what is supported."""
    cluster, work = hosts
    node1 = cluster.hosts[1]
    original = cluster.exec(node1, "cat /etc/os-release").stdout
    cluster.exec(node1, "cat > /etc/os-release", input=ROCKY_OS_RELEASE)
    try:
        proc = preflight(inventory(cluster, work / "rocky.yml", nfs_server=True))
        assert proc.returncode != 0, tail(proc)
        out = proc.stdout
        # (Ansible names it "Rocky" from /etc/redhat-release on a real Rocky host, "Rocky Linux" from os-release here)
        assert re.search(rf"{node1.name} runs Rocky( Linux)? 9\.3; site\.yml supports Debian 12 or Ubuntu 22\.04 "
                         r"and later", out), tail(proc)
        assert "Nothing was changed" in out
        assert f"{cluster.hosts[0].name} runs" not in out  # the Debian host passed the check
        assert all(h.get("changed", 0) == 0 for h in recap(out).values()), out[-3000:]
    finally:
        cluster.exec(node1, "cat > /etc/os-release", input=original)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_an_nfs_server_that_does_not_answer_is_named_before_any_role_waits_on_it(hosts):
    """The walk's dead end (issue 45): with nfs_server_manage_service: false, as the systemd
    refusal advises, site.yml starts no nfsd; the clients then waited 300 s for port 2049 and
    said only "Timeout when waiting for <host>:2049". Preflight asks the port first (5 s) and
    names the server, why site.yml starts none, and the two ways forward; with
    nfs_client_mount: false (the hosts mount the storage themselves) nothing is asked."""
    import time

    cluster, work = hosts
    server = cluster.hosts[0]
    inv = inventory(cluster, work / "unmanaged.yml", nfs_server=True, extra={"nfs_server_manage_service": False})
    started = time.monotonic()
    proc = preflight(inv, "--skip-tags", "docker,image")
    took = time.monotonic() - started
    assert proc.returncode != 0, tail(proc)
    out = proc.stdout
    assert f"no NFS server answers on {server.ip}:2049" in out, tail(proc)
    assert "site.yml starts none there (nfs_server_manage_service: false)" in out, tail(proc)
    assert "Start the NFS server there" in out and "set nfs_client_mount: false" in out and "Nothing was changed" in out
    assert took < 120, f"{took:.0f} s"
    assert all(h.get("changed", 0) == 0 for h in recap(out).values()), out[-3000:]
    mounted = inventory(cluster, work / "self-mounted.yml", nfs_server=True,
                        extra={"nfs_server_manage_service": False, "nfs_client_mount": False})
    proc = preflight(mounted, "--skip-tags", "docker,image")
    assert proc.returncode == 0, tail(proc)
