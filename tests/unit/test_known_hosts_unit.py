"""known_hosts read once per run and shared by every connection (ftbundle.ssh.KnownHosts):
the same keys as paramiko's own loading, found without re-reading the files per host."""

from __future__ import annotations

import subprocess
import time

import pytest
from paramiko.hostkeys import HostKeys

from ftbundle import ssh
from ftbundle.inventory import Host


@pytest.fixture(scope="module")
def pubkeys(tmp_path_factory) -> dict[str, str]:
    """One real public key of each type: {type: base64}."""
    d = tmp_path_factory.mktemp("keys")
    keys = {}
    for kind in ("rsa", "ecdsa", "ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(d / kind)], check=True)
        ktype, data = (d / f"{kind}.pub").read_text().split()[:2]
        keys[ktype] = data
    return keys


def host(address: str, port: int = 22, known_hosts: str | None = None) -> Host:
    return Host(name=address, address=address, port=port, user="root", known_hosts=known_hosts)


def paramiko_keys(path, name) -> dict:
    """What paramiko's own loading finds for ``name``."""
    keys = HostKeys()
    keys.load(str(path))
    found = keys.lookup(name)
    return {} if found is None else {t: found[t] for t in found}


def test_same_keys_as_paramiko_plain_hashed_ports_and_first_wins(tmp_path, pubkeys):
    (rsa_t, rsa), (ec_t, ec), (ed_t, ed) = pubkeys.items()
    path = tmp_path / "known_hosts"
    path.write_text(
        "# comment\n\n"
        f"10.0.0.1,node1 {ed_t} {ed}\n"
        f"10.0.0.1 {rsa_t} {rsa}\n"
        f"10.0.0.1 {ed_t} {ec}\n"  # a second key of a type already given: the first wins
        f"[10.0.0.2]:2222 {ec_t} {ec}\n"
        f"{HostKeys.hash_host('10.0.0.3')} {ed_t} {ed}\n"
        )
    index = ssh.KnownHosts((str(path),))
    for name in ("10.0.0.1", "node1", "[10.0.0.2]:2222", "10.0.0.3", "10.0.0.2", "10.0.0.9", "10.0.0.4"):
        ours = {t: k.get_base64() for t, k in index.keys_for(name).items()}
        theirs = {t: k.get_base64() for t, k in paramiko_keys(path, name).items()}
        assert ours == theirs, name
    assert set(index.keys_for("10.0.0.1")) == {rsa_t, ed_t}
    assert index.keys_for("10.0.0.1")[ed_t].get_base64() == ed
    with path.open("a") as f:  # a broken line: skipped, as OpenSSH skips it (paramiko stops reading)
        f.write(f"10.0.0.9 {ed_t} not-base64!\n|1|bad|salt {ed_t} {ed}\n10.0.0.9 {rsa_t} {rsa}\n")
    assert set(ssh.KnownHosts((str(path),)).keys_for("10.0.0.9")) == {rsa_t}
    assert ssh.lookup_name("10.0.0.2", 2222) == "[10.0.0.2]:2222" and ssh.lookup_name("h", 22) == "h"


def test_connections_share_one_read_and_see_a_changed_file(tmp_path, pubkeys, monkeypatch):
    """Every connection of a run gets its host's keys from one read of the files; a file
    that changes (a key recorded by --accept-new-host-keys) is read again."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/known_hosts of the machine's
    ed_t, ed = next((t, k) for t, k in pubkeys.items() if "ed25519" in t)
    path = tmp_path / "kh"
    n = 512
    path.write_text("".join(f"198.18.{i // 250}.{i % 250 + 2} {t} {k}\n"
                            for i in range(n) for t, k in pubkeys.items()))
    reads = []
    real_init = ssh.KnownHosts.__init__

    def counted_init(self, paths):
        reads.append(paths)
        real_init(self, paths)

    monkeypatch.setattr(ssh.KnownHosts, "__init__", counted_init)
    hosts = [host(f"198.18.{i // 250}.{i % 250 + 2}", known_hosts=str(path)) for i in range(n)]
    started = time.process_time()
    conns = [ssh.connect(h) for h in hosts]
    took = time.process_time() - started
    assert len(reads) == 1
    for h, conn in zip(hosts, conns):
        assert set(conn.client.get_host_keys().lookup(h.address).keys()) == set(pubkeys)
    # (paramiko's own loading took ~300 ms of CPU per connection at 256 hosts: n^3 in all)
    assert took < 30, took

    with path.open("a") as f:
        f.write(f"[198.18.9.9]:2200 {ed_t} {ed}\n")
    conn = ssh.connect(host("198.18.9.9", 2200, known_hosts=str(path)))
    assert len(reads) == 2
    assert set(conn.client.get_host_keys().lookup("[198.18.9.9]:2200").keys()) == {ed_t}
    assert ssh.connect(host("198.18.9.10", known_hosts=str(path))).client.get_host_keys().lookup("198.18.9.10") is None


def test_a_connection_leaves_the_shared_config_untouched(tmp_path):
    """Every connection shares one Fabric Config (ssh._config). Fabric's Connection.__init__ sets
    `inline_ssh_env`, and a name its class lacks is stored into that Config, whose merge empties it
    for a moment: another thread opening a connection then read no 'forward_agent' (CI, a bastion's
    parallel opens). Making connections must leave the shared Config as it was, and a hundred made
    at once by 8 threads all read their settings."""
    import threading

    shared = ssh._config()
    before = dict(shared._modifications)
    host = Host(name="h", address="192.0.2.1", port=22, user="root", key_file=str(tmp_path / "k"),
                known_hosts=str(tmp_path / "known_hosts"))
    errors: list[BaseException] = []

    def make():
        try:
            for _ in range(100):
                conn = ssh.connect(host)
                assert conn.forward_agent is False
        except BaseException as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert shared._modifications == before
