"""Opening many connections against sshd's limits (ftbundle.cluster.Cluster.open): hosts at a
stock `MaxStartups 10:30:100` (the test image raises it to 200; set back here), directly and
through a ProxyJump bastion.

Many hosts behind one sshd are made as inventory aliases of one container (same address,
other names): each alias is a connection of its own, as n real hosts behind a bastion are."""

from __future__ import annotations

import subprocess
import time

import pytest

from ftbundle.cluster import Cluster
from ftbundle.inventory import Host

pytestmark = pytest.mark.cluster

ALIASES = 30


@pytest.fixture(scope="module")
def stock(testhost_image, tmp_path_factory):
    """Two hosts whose sshd runs with OpenSSH's defaults for MaxStartups and MaxSessions."""
    from tests.support.cluster import Cluster as TestCluster

    c = TestCluster(2, shared_dir=tmp_path_factory.mktemp("shared"), image=testhost_image).up()
    try:
        for h in c.hosts:
            c.exec(h, "rm /etc/ssh/sshd_config.d/ftbundle-testhost.conf && "
                      "printf 'PermitRootLogin prohibit-password\\nPasswordAuthentication no\\nUseDNS no\\n' "
                      "> /etc/ssh/sshd_config.d/stock.conf && sshd -T | grep -E '^max(startups|sessions) ' "
                      "&& kill -HUP $(cat /run/sshd.pid)")
        for h in c.hosts:  # sshd re-executes itself: wait until it answers again
            deadline = time.monotonic() + 30
            while subprocess.run(c.ssh_argv(h) + ["true"], capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, f"{h.name}: sshd did not come back"
                time.sleep(0.2)
        yield c
    finally:
        c.down()


def aliases(c, target, n: int = ALIASES, **kw) -> list[Host]:
    return [Host(name=f"alias{i}", address=target.ip, user="root", key_file=str(c.key_file),
                 known_hosts=str(c.known_hosts), **kw) for i in range(n)]


def sshd_sessions(c, h) -> int:
    """Connections (authenticated or not) that h's sshd is serving now."""
    out = c.exec(h, "ss -Htn state established '( sport = :22 )' | wc -l").stdout
    return int(out.strip())


def test_stock_maxstartups_refuses_a_burst_but_capped_opening_reaches_every_host(stock):
    target = stock.hosts[1]
    # the sshd really is at its stock limit: an uncapped burst without retries is refused
    burst = Cluster(aliases(stock, target), max_startups=ALIASES, max_handshakes=ALIASES, connect_tries=1)
    burst.open()
    burst.close()
    assert burst.errors, "a stock sshd refused none of 30 simultaneous new connections"
    assert all("cannot SSH to" in e for e in burst.errors.values())

    with Cluster(aliases(stock, target)) as capped:  # the defaults: 8 at a time per sshd
        capped.open()
        assert capped.errors == {}
        assert all(capped.alive(h) for h in capped.hosts)
        assert sshd_sessions(stock, target) >= ALIASES

    with Cluster(aliases(stock, target), max_startups=ALIASES, max_handshakes=ALIASES) as retried:
        retried.open()  # uncapped, but refusals are tried again with backoff
        assert retried.errors == {}


def test_connecting_threads_are_capped_not_one_per_host(stock):
    """Opening n hosts uses at most max_handshakes connecting threads (each host's transport
    keeps one thread of its own, paramiko's, and each handshake in progress has paramiko's
    handshake timer, a threading.Timer of packet.py's start_handshake, until it ends: counted
    at the peak 35-37 of 30 hosts, which failed the bound without them one run in two)."""
    import threading

    before = threading.active_count()
    with Cluster(aliases(stock, stock.hosts[1]), max_handshakes=4) as cluster:
        cluster.open(background=True)
        peak = 0
        while cluster._opening is not None and cluster._opening.is_alive():
            peak = max(peak, threading.active_count() - before)
            time.sleep(0.005)
        cluster.wait_open()
        assert cluster.errors == {}
    assert peak <= 1 + 4 + 4 + ALIASES, peak  # the opener, 4 connecting (4 timers), a transport per host


def test_through_a_stock_bastion_one_connection_to_it(stock):
    bastion, target = stock.hosts
    hosts = aliases(stock, target, proxy_jump=f"root@{bastion.ip}")
    with Cluster(hosts) as cluster:
        cluster.open()
        assert cluster.errors == {}
        results = cluster.run_all([(h, ["hostname"]) for h in hosts], timeout=30)
        name = stock.exec(target, "hostname").stdout.strip()
        assert [getattr(r, "stdout", r) for r in results] == [name + "\n"] * len(hosts)
        # every host is tunnelled through one shared connection to the bastion
        assert sshd_sessions(stock, bastion) == 1


def test_unreachable_after_retries_names_the_cause(stock):
    """A host whose sshd refuses is tried again, then reported with the tries it took."""
    target = stock.hosts[1]
    host = Host(name="closed", address=target.ip, port=2222, user="root", key_file=str(stock.key_file),
                known_hosts=str(stock.known_hosts))
    cluster = Cluster([host], connect_tries=3)
    cluster.open()
    assert "closed" in cluster.errors
    assert "refused" in cluster.errors["closed"].lower() and "(3 tries)" in cluster.errors["closed"]
