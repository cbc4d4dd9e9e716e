"""molecule/default/tasks/rendezvous.yml (included by the scenario's verify.yml) on two plain
containerized hosts: it passes only when rank 0's rendezvous port drops the outsider (the
controller) while rank 0 listens and the members reach it, and fails for an open port.

The firewall here is one nftables rule set by the test (the role's own is checked by the
Molecule scenario): a drop of the controller's packets to port 29500 on rank 0.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.helpers import REPO
from tests.cluster.test_provisioning import BIN, run, tail

pytestmark = pytest.mark.cluster

PLAY = """- name: rank 0's rendezvous port, as verify.yml checks it
  hosts: trainers
  gather_facts: false
  vars:
    _rank0: "{{ ansible_play_hosts | first }}"
    _rank0_addr: "{{ hostvars[_rank0].ftb_address }}"
  tasks:
    - ansible.builtin.include_tasks: %s
"""
DROP = ("table inet ftb_verify_test {\n"
        "  chain input { type filter hook input priority 0; policy accept;\n"
        "    ip saddr %s tcp dport 29500 drop; }\n"
        "}\n")


@pytest.fixture(scope="module")
def hosts(testhost_image):
    work = Path(tempfile.mkdtemp(prefix="ftb-verify-", dir="/tmp"))
    try:
        with Cluster(2, name_prefix="ftb-vrfy", shared_dir=work / "shared", image=testhost_image) as cluster:
            inv = cluster.write_inventory(work / "hosts.yml",
                                          per_host={h.name: {"ftb_address": h.ip} for h in cluster.hosts})
            (work / "play.yml").write_text(PLAY % (REPO / "molecule" / "default" / "tasks" / "rendezvous.yml"))
            yield cluster, work, inv
    finally:
        shutil.rmtree(work, ignore_errors=True)


def play(work: Path, inv: Path):
    return run([str(BIN / "ansible-playbook"), "-i", str(inv), str(work / "play.yml")], timeout=300)


def test_an_open_rendezvous_port_fails_the_check(hosts):
    cluster, work, inv = hosts
    proc = play(work, inv)
    assert proc.returncode != 0, tail(proc)
    assert 'got "open" from' in proc.stdout, tail(proc)
    assert cluster.pgrep(cluster.hosts[0], "ftb-verify-listener") == [], proc.stdout  # stopped though the check failed


def test_a_dropped_rendezvous_port_passes_and_the_listener_is_gone_after(hosts):
    cluster, work, inv = hosts
    controller = cluster.exec(cluster.hosts[0], "ip route | awk '/^default/ {print $3}'").stdout.strip()
    cluster.exec(cluster.hosts[0], "nft -f -", input=DROP % controller)
    try:
        proc = play(work, inv)
    finally:
        cluster.exec(cluster.hosts[0], "nft delete table inet ftb_verify_test", check=False)
    assert proc.returncode == 0, tail(proc)
    assert cluster.pgrep(cluster.hosts[0], "ftb-verify-listener") == []
