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
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.test_provisioning import BIN, TESTBED, recap, registry_alive, run, tail  # noqa: F401 (autouse)
from tests.support.helpers import ASSETS
from tests.support.testbed import ensure_registry

# this checkout's names and addresses for the scenario (tests/support/testbed.py; slot 0: ftb-liv-node0..2,
# 198.18.249.11-13, the registries on :5000 and :5001)
SCENARIO = TESTBED.livedin
HOSTS = SCENARIO.hosts
REGISTRY = f"{SCENARIO.gateway}:{TESTBED.registry_port}"  # the controller's registry, as these hosts reach it


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


@pytest.fixture(scope="module")
def livedin(testhost_image):
    """The lived-in hosts, created and prepared (not yet converged); destroyed afterwards."""
    pushed = run(["bash", ".ci/registry.sh"], env=dict(os.environ, **TESTBED.script_env()), timeout=1200)
    assert pushed.returncode == 0, tail(pushed)
    image = f"{REGISTRY}/{pushed.stdout.strip().splitlines()[-1]}"
    workdir = Path(tempfile.mkdtemp(prefix="ftb-livedin-", dir="/tmp"))
    (workdir / "shared").mkdir()
    env = dict(os.environ, FTB_TESTHOST_IMAGE=testhost_image, FTB_MOLECULE_IMAGE=image,
               FTB_LIVEDIN_WORKDIR=str(workdir), PATH=f"{BIN}:{os.environ['PATH']}",
               ANSIBLE_FORCE_COLOR="0", PY_COLORS="0", **TESTBED.molecule_env(SCENARIO, workdir / "state"))
    scenario = Scenario(env)
    SCENARIO.remove()  # debris of an interrupted session (tests/support/testbed.py)
    try:
        proc = scenario("create")  # Molecule's create runs prepare.yml too
        assert proc.returncode == 0, tail(proc, 12000)
        yield scenario
    finally:
        SCENARIO.remove()
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
    # named, not silently closed: a service of the admin's inside the training range, and
    # the admin's own fstab line for ftbundle's export (kept as it is)
    said = " ".join(proc.stdout.split())
    assert "listening in the training range 32768-60999, closed to non-members from now on: 40000" in said, \
        tail(proc, 12000)
    assert f"keeping the administrator's fstab entry '{SCENARIO.addresses[0]}:/srv/ftbundle /shared nfs rw,hard,vers=4.1" \
        in said, tail(proc, 12000)
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
        assert host in known and SCENARIO.addresses6[i] in known, known
        assert SCENARIO.addresses[i] in rules and SCENARIO.addresses6[i] in rules, rules
    assert "bastion.example.com" in known
    verified = livedin("verify")
    assert verified.returncode == 0, tail(verified, 12000)


def connects(address: str, port: int, host: str | None = None) -> bool:
    """Whether a TCP connection to address:port is accepted, from the controller or from a host."""
    code = (f"import socket; s = socket.create_connection(({address!r}, {port}), timeout=3); "
            "s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); print(s.recv(12).decode())")
    argv = ["docker", "exec", host, "python3", "-c", code] if host else [sys.executable, "-c", code]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return proc.returncode == 0 and proc.stdout.startswith("HTTP/1.0 200")


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_port_a_container_publishes_keeps_the_hosts_verdict(livedin):
    """`docker run -p` DNATs around the input chain: by default (compose) the firewall adds no
    forward chain, so a non-member (the controller, the network's gateway) still reaches a port a
    container publishes, as before site.yml; members too, and the host itself; and a container
    reaches its host on a port of the training range. With
    `firewall_mode: strict` on that host, its forward chain keeps the published port to the
    members (and the host itself); back to compose, the controller reaches it again."""
    image = docker_exec(HOSTS[0], "cat /etc/ftbundle/image.ref").strip()
    # UDP echo on node0 over IPv6 (for strict mode's DHCPv6 exception, below)
    subprocess.run(["docker", "cp", str(ASSETS / "ports.py"), f"{HOSTS[0]}:/usr/local/bin/ftb-test-ports.py"],
                   check=True, capture_output=True, timeout=60)
    subprocess.run(["docker", "exec", "-d", HOSTS[0], "python3", "/usr/local/bin/ftb-test-ports.py", "udp6:546",
                    "udp6:547"], check=True, timeout=60)
    docker_exec(HOSTS[0], f"docker rm -f published >/dev/null 2>&1; docker run -d --name published -p 18080:18080 "
                          f"--pull=never {image} python3 -m http.server 18080")
    try:
        address = SCENARIO.addresses[0]
        deadline = time.monotonic() + 60
        while not connects(address, 18080, host=HOSTS[1]) and time.monotonic() < deadline:
            time.sleep(1)
        assert connects(address, 18080, host=HOSTS[1])  # a member: node1
        assert connects("127.0.0.1", 18080, host=HOSTS[0])  # the host itself (docker-proxy)
        assert connects(address, 18080)  # a non-member: the controller
        # a container reaches its own host, also on a port in the training range (closed to
        # non-members, which the container's address is): its packets come in on docker0
        gateway = docker_exec(HOSTS[0], "docker network inspect bridge -f '{{(index .IPAM.Config 0).Gateway}}'").strip()
        probe = f"import socket; socket.create_connection(({gateway!r}, 40000), timeout=3); print('reached')"
        assert docker_exec(HOSTS[0], f'docker run --rm --pull=never {image} python3 -c "{probe}"').strip() == "reached"

        strict = livedin("converge", "--", "--tags", "firewall", "--limit", HOSTS[0], "-e", "firewall_mode=strict")
        assert strict.returncode == 0, tail(strict, 12000)
        assert "chain forward" in docker_exec(HOSTS[0], "nft list table inet ftbundle")
        assert not connects(address, 18080)  # DNATed around the input chain, dropped in the forward chain
        assert connects(address, 18080, host=HOSTS[1])
        assert connects("127.0.0.1", 18080, host=HOSTS[0])
        # a DHCPv6 server's reply (UDP 546, from a link-local address: never a member's) passes
        # strict mode's drop policy; the same datagram to 547 does not, a member's does
        link_local = docker_exec(HOSTS[0], "ip -6 -o addr show dev eth0 scope link").split()[3].split("/")[0]
        seen6 = {("link-local", 546): udp6_echo(link_local, 546), ("link-local", 547): udp6_echo(link_local, 547),
                 ("member", 547): udp6_echo(SCENARIO.addresses6[0], 547)}
        assert seen6 == {("link-local", 546): "open", ("link-local", 547): "closed", ("member", 547): "open"}
    finally:
        subprocess.run(["docker", "exec", HOSTS[0], "pkill", "-f", "ftb-test-ports.py"], capture_output=True, timeout=60)
        docker_exec(HOSTS[0], "docker rm -f published >/dev/null 2>&1; true")
        back = livedin("converge", "--", "--tags", "firewall", "--limit", HOSTS[0])
        assert back.returncode == 0, tail(back, 12000)
    assert "chain forward" not in docker_exec(HOSTS[0], "nft list table inet ftbundle")


def udp6_echo(address: str, port: int) -> str:
    """"open" or "closed": whether node0's UDP echo on address:port (tests/assets/ports.py udp6)
    answers node1 (tests/assets/probe.py; from node1's link-local address when `address` is
    node0's, scoped to eth0)."""
    target = f"{address}%eth0" if address.startswith("fe80") else address
    out = subprocess.run(["docker", "exec", "-i", HOSTS[1], "python3", "-", target, "udp", str(port)],
                         input=(ASSETS / "probe.py").read_text(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0]


def loaded_digest(host: str) -> str:
    rules = docker_exec(host, "nft list table inet ftbundle 2>/dev/null || true")
    # the table's comment: "ftbundle <digest of the file it was loaded from>"
    return next((line.split('"')[1].split()[-1] for line in rules.splitlines() if line.strip().startswith("comment ")), "")


@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_a_run_interrupted_after_the_firewall_is_completed_by_the_next(livedin):
    """A run that fails after the firewall role (here: nccl_env, a wrong interface), and an
    admin's `flush ruleset` that took our table away: the next run loads the file again
    (the loaded table's digest differs from the file's), and the loaded set has the member
    the interrupted run added."""
    extra = ["-e", '{"firewall_extra_cluster_addresses": ["198.51.100.7"]}']
    # (the firewall's play, then nccl_env's failing: what a whole run that stops there leaves, without
    # converging again every role the earlier tests converged)
    failed = livedin("converge", "--", "--tags", "firewall,nccl", *extra, "-e", "nccl_env_socket_ifname=ftb-nope0")
    assert failed.returncode != 0, tail(failed)
    assert "ftb-nope0" in failed.stdout, tail(failed, 12000)
    for host in HOSTS:
        assert "198.51.100.7" in docker_exec(host, "cat /etc/ftbundle/firewall.nft")
    docker_exec(HOSTS[1], "nft delete table inet ftbundle")  # gone, as after the admin's `flush ruleset`
    try:
        again = livedin("converge", "--", "--tags", "firewall", *extra)
        assert again.returncode == 0, tail(again, 12000)
        hosts = recap(again.stdout)
        assert hosts[HOSTS[1]]["changed"] >= 1 and hosts[HOSTS[0]]["changed"] == 0, again.stdout[-3000:]
        rules = docker_exec(HOSTS[1], "nft list table inet ftbundle")
        assert "198.51.100.7" in rules, rules
        file_digest = docker_exec(HOSTS[1], "grep -o 'comment \"ftbundle [0-9a-f]*' /etc/ftbundle/firewall.nft").split()[-1]
        assert loaded_digest(HOSTS[1]) == file_digest
    finally:
        back = livedin("converge", "--", "--tags", "firewall")
        assert back.returncode == 0, tail(back, 12000)
    assert "198.51.100.7" not in docker_exec(HOSTS[1], "nft list table inet ftbundle")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_dockerd_flags_and_iptables_drop_policies_are_refused_by_name_before_anything_changes(livedin):
    dropin = "/etc/systemd/system/docker.service.d/registry.conf"
    docker_exec(HOSTS[2], f"printf '[Service]\\nExecStart=\\nExecStart=/usr/bin/dockerd --insecure-registry=10.9.0.5:5000\\n' > {dropin}")
    before = docker_exec(HOSTS[2], "cat /etc/docker/daemon.json")
    try:
        proc = livedin("converge", "--", "--tags", "docker", "--limit", HOSTS[2],
                       "-e", '{"container_runtime_insecure_registries": ["198.18.249.1:5009"]}')
        assert proc.returncode != 0, tail(proc)
        assert f"dockerd already gets --insecure-registry in {dropin}" in " ".join(proc.stdout.split()), \
            tail(proc, 12000)
        assert "Nothing was changed" in proc.stdout
        assert docker_exec(HOSTS[2], "cat /etc/docker/daemon.json") == before
    finally:
        docker_exec(HOSTS[2], f"rm -f {dropin}")

    rules = docker_exec(HOSTS[2], "cat /etc/ftbundle/firewall.nft")
    # as an administrator sets a drop policy: after rules that keep SSH and answers coming in
    # (Ansible reaches the host over SSH; without them the policy would cut it off too)
    keep = ["INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT", "INPUT -p tcp --dport 22 -j ACCEPT"]
    docker_exec(HOSTS[2], "".join(f"iptables -I {rule}; " for rule in keep) + "iptables -P INPUT DROP")
    try:
        proc = livedin("converge", "--", "--tags", "firewall", "--limit", HOSTS[2],
                       "-e", '{"firewall_extra_cluster_addresses": ["198.51.100.8"]}')
        assert proc.returncode != 0, tail(proc)
        out = " ".join(proc.stdout.split())
        assert "nftables table ip filter, chain INPUT: input policy drop (iptables -P INPUT DROP)" in out, tail(proc, 12000)
        assert docker_exec(HOSTS[2], "cat /etc/ftbundle/firewall.nft") == rules
    finally:
        docker_exec(HOSTS[2], "iptables -P INPUT ACCEPT; " + "".join(f"iptables -D {rule}; " for rule in keep))


# ---------------------------------------------------------------------------------------
# A registry that requires a login (.ci/registry-auth.sh: htpasswd, bcrypt), credentials
# from an Ansible Vault file. Runs last: it changes the recorded reference.

AUTH_REGISTRY = f"{SCENARIO.gateway}:{TESTBED.auth_registry_port}"  # the controller's login-only registry, as these hosts reach it
AUTH_USER = "ftbundle-test"
AUTH_PASSWORD_FILE = TESTBED.auth_registry_root / "password"


@pytest.fixture(scope="module")
def auth_registry_pushed() -> tuple[str, str]:
    """(the image pushed there as repo@digest, as the hosts reach it; the tag it was pushed as)."""
    pushed = run(["bash", ".ci/registry-auth.sh"], env=dict(os.environ, FTB_PYTHON=sys.executable, **TESTBED.script_env()), timeout=1200)
    assert pushed.returncode == 0, tail(pushed)
    image = f"{AUTH_REGISTRY}/{pushed.stdout.strip().splitlines()[-1]}"
    tag = run(["bash", ".ci/train-image.sh"]).stdout.strip().splitlines()[-1].split(":")[-1]
    return image, f"{image.split('@')[0]}:{tag}"


@pytest.fixture
def auth_registry(auth_registry_pushed) -> tuple[str, str]:
    """The same, with the login-only registry answering at the start of each test."""
    ensure_registry(TESTBED.auth_registry_port, ".ci/registry-auth.sh", FTB_PYTHON=sys.executable,
                    **TESTBED.script_env())
    return auth_registry_pushed


def vault_vars(tmp_path: Path, password: str) -> list[str]:
    """ftb_registry_username/password in an ansible-vault encrypted vars file: the
    arguments that hand it to ansible-playbook."""
    vault_pass = tmp_path / "vault-pass"
    vault_pass.write_text(secrets.token_urlsafe(16) + "\n")
    vault_pass.chmod(0o600)
    creds = tmp_path / "registry.yml"
    creds.write_text(yaml.safe_dump({"ftb_registry_username": AUTH_USER, "ftb_registry_password": password}))
    encrypted = run([str(BIN / "ansible-vault"), "encrypt", "--vault-password-file", str(vault_pass), str(creds)])
    assert encrypted.returncode == 0, tail(encrypted)
    assert creds.read_text().startswith("$ANSIBLE_VAULT;") and password not in creds.read_text()
    return ["-e", f"@{creds}", "--vault-password-file", str(vault_pass)]


def no_credentials_left(host: str) -> None:
    """No docker config of the pull's is left, and none with the registry's login."""
    left = docker_exec(host, f"ls -d /tmp/ftbundle-docker-* 2>/dev/null; grep -rl '{AUTH_REGISTRY}' "
                             "/root/.docker /home/trainer/.docker 2>/dev/null; true")
    assert left.strip() == "", f"{host}: {left}"


@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_a_wrong_registry_password_fails_clearly_and_shows_no_password(livedin, auth_registry, tmp_path):
    image, tagged = auth_registry
    wrong = "wrong-" + secrets.token_urlsafe(12)
    right = AUTH_PASSWORD_FILE.read_text().strip()
    before = {host: docker_exec(host, "cat /etc/ftbundle/image.ref") for host in HOSTS}

    proc = livedin("converge", "--", "--tags", "image", "-e", f"ftb_image={image}", *vault_vars(tmp_path, wrong))
    assert proc.returncode != 0, tail(proc)
    out = proc.stdout + proc.stderr
    for host in HOSTS:
        assert f"{host}: docker login to {AUTH_REGISTRY} as {AUTH_USER} failed:" in proc.stdout, tail(proc, 12000)
    assert "401 Unauthorized" in proc.stdout and "Nothing was pulled" in proc.stdout, tail(proc, 12000)
    assert wrong not in out and right not in out
    for host in HOSTS:
        assert docker_exec(host, "cat /etc/ftbundle/image.ref") == before[host]
        assert docker_exec(host, f"docker image inspect {image} >/dev/null 2>&1 && echo present; true") == ""
        no_credentials_left(host)

    # a tag, resolved on the controller, with no credentials at all: the registry asks for a login
    anonymous = livedin("converge", "--", "--tags", "image", "-e", f"ftb_image={tagged}",
                        "-e", "ftb_image_resolve_tag=true", "-e", "training_image_registry_scheme=http")
    assert anonymous.returncode != 0, tail(anonymous)
    assert f"{AUTH_REGISTRY} refused to show ftbundle/train-cpu:{tagged.split(':')[-1]} (HTTP 401)" in anonymous.stdout, \
        tail(anonymous, 12000)
    assert "to an anonymous client: set ftb_registry_username and ftb_registry_password" in anonymous.stdout


@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_registry_login_from_vault_resolves_the_tag_and_pulls_the_digest(livedin, auth_registry, tmp_path):
    """The controller resolves the tag through the registry's Basic login, every host logs
    in through a throwaway docker config and pulls the digest; no credentials stay."""
    image, tagged = auth_registry
    right = AUTH_PASSWORD_FILE.read_text().strip()
    proc = livedin("converge", "--", "--tags", "image", "-e", f"ftb_image={tagged}", "-e", "ftb_image_resolve_tag=true",
                   "-e", "training_image_registry_scheme=http", *vault_vars(tmp_path, right))
    assert proc.returncode == 0, tail(proc, 12000)
    assert right not in proc.stdout + proc.stderr
    hosts = recap(proc.stdout)
    assert sorted(hosts) == HOSTS and all(h["changed"] >= 1 for h in hosts.values()), proc.stdout[-3000:]  # pulled
    ids = set()
    for host in HOSTS:
        assert docker_exec(host, "cat /etc/ftbundle/image.ref") == image + "\n"
        ids.add(docker_exec(host, f"docker image inspect -f '{{{{.Id}}}}' {image}").strip())
        no_credentials_left(host)
    assert len(ids) == 1, ids
