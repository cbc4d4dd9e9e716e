"""`ftbundle check` at the largest host count CI holds cheaply (24 containerized hosts): it
passes on healthy hosts under this machine's load, and still finds the faults planted on
two of them, each reported once with the host folded in (the 256-host case: bench/check.py)."""

from __future__ import annotations

import pytest

from tests.cluster.test_check import check, leftovers

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

N = 24


@pytest.fixture(scope="module")
def big(testhost_image, tmp_path_factory):
    from tests.support.cluster import Cluster

    c = Cluster(N, shared_dir=tmp_path_factory.mktemp("shared"), image=testhost_image).up()
    try:
        yield c
    finally:
        c.down()


def test_check_at_scale_passes_then_finds_two_planted_faults(big, tmp_path):
    for h in big.hosts:  # /srv/shared is the shared storage everywhere ...
        big.exec(h, f"mkdir -p /srv && ln -s {big.shared_dir} /srv/shared")
    healthy, text = check(big, tmp_path / "healthy", shared_dir="/srv/shared")
    assert healthy.ok, text
    assert f"ssh         reachable: node[0-{N - 1}]" in text.splitlines()
    assert f"            sees node[0-{N - 1}]: node[0-{N - 1}]" in text.splitlines()
    assert leftovers(big) == {}

    bad_dir, bad_port = big.hosts[7], big.hosts[13]
    big.exec(bad_dir, "rm /srv/shared && mkdir /srv/shared")  # ... but a local directory on one host
    big.exec(big.hosts[0], "nft -f -", input=(  # and rank 0's firewall drops the port for another
        "table inet ftbtest {\n  chain input {\n    type filter hook input priority -5; policy accept;\n"
        f"    ip saddr {bad_port.ip} tcp dport 29500 drop\n  }}\n}}\n"))
    try:
        report, text = check(big, tmp_path / "faulty", shared_dir="/srv/shared")
    finally:
        big.exec(big.hosts[0], "nft delete table inet ftbtest", check=False)
    assert not report.ok
    assert {c.name for c in report.checks if not c.ok} == {"shared_dir", "master_port"}, text
    assert "master_port: node13 cannot connect to node0 port 29500 (firewall? wrong ftb_master_addr?)" \
        in report.failures, report.failures
    others = f"node[0-6,8-{N - 1}]"
    assert f"shared_dir: node7 does not see the sentinel of {others} in /srv/shared" in report.failures, \
        report.failures
    assert f"shared_dir: {others} does not see the sentinel of node7 in /srv/shared" in report.failures, \
        report.failures
    assert len(report.failures) == 3, report.failures
    assert leftovers(big) == {}
