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

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import ASSETS
from tests.cluster.test_provisioning import BIN, TESTBED, recap, run, tail

# this checkout's names and subnet for the scenario (tests/support/testbed.py; slot 0: ftb-sd-node0..1, 198.18.251.0/24)
SCENARIO = TESTBED.systemd
HOSTS = SCENARIO.hosts[:2]
SKIP = ["--skip-tags", "image,verify"]


def docker_exec(host: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "exec", host, "bash", "-c", command], capture_output=True, text=True,
                          timeout=300)


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

    molecule.env = env  # for ansible-playbook runs of the tests' own (its inventory is the scenario's)

    SCENARIO.remove()  # debris of an interrupted session (tests/support/testbed.py)
    try:
        proc = molecule("create")  # Molecule's create runs prepare.yml too
        assert proc.returncode == 0, tail(proc, 12000)
        yield molecule
    finally:
        SCENARIO.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def state(host: str) -> str:
    proc = docker_exec(host, "ls /etc/ftbundle /etc/systemd/system/ftbundle-firewall.service 2>&1; "
                             "nft list tables; systemctl list-units --all 'ftbundle*' --no-legend; cat /etc/fstab")
    return proc.stdout


def cgroups_outside_the_container(host: str) -> list[str]:
    """The host's processes whose cgroup, seen from this machine, is not under the container's
    own: with the machine's /sys/fs/cgroup bind-mounted (cgroup v1), every host's systemd put
    its units in the machine's one /system.slice, and one host stopping a unit emptied the
    other's cgroup (status=219/CGROUP in verify.yml; .ci/testhost-systemd-image.sh)."""
    cid, init = subprocess.run(["docker", "inspect", "-f", "{{.Id}} {{.State.Pid}}", host], capture_output=True,
                               text=True, check=True).stdout.split()
    # the container's processes: its init and every descendant (not `docker top`, which lists
    # only what is left in the container's own cgroup)
    children: dict[str, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(stat.parent.name)
    pids, todo = [], [init]
    while todo:
        pids.append(todo.pop())
        todo += children.get(pids[-1], [])
    assert len(pids) > 3, f"{host}: only {pids} under its init {init}"
    outside = []
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:  # ended since
            continue
        outside += [f"{pid} {line}" for line in lines if cid not in line]
    return outside


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_check_converge_idempotence_verify_on_hosts_with_systemd(scenario):
    for host in HOSTS:
        assert docker_exec(host, "cat /proc/1/comm").stdout.strip() == "systemd"
        assert cgroups_outside_the_container(host) == []
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


# --- the firewall's own options, seen from a non-member (the controller) and a member (node1) ---

NODE0, NODE1 = HOSTS
ADDRESS0 = SCENARIO.addresses[0]


def firewall_run(scenario, variables: dict, host: str = NODE0) -> subprocess.CompletedProcess:
    """The firewall role alone on one host (over SSH, as Molecule's inventory has it), with these variables."""
    return scenario("converge", "--", "--tags", "firewall", "--limit", host, "-e", json.dumps(variables))


def start_listeners(unit: str, *specs: str) -> None:
    """tests/assets/ports.py on node0 as a transient unit of its own (stopped by stop_listeners)."""
    copied = subprocess.run(["docker", "cp", str(ASSETS / "ports.py"), f"{NODE0}:/usr/local/bin/ftb-test-ports.py"],
                            capture_output=True, text=True, timeout=120)
    assert copied.returncode == 0, copied.stderr
    started = docker_exec(NODE0, f"systemd-run --unit {unit} python3 /usr/local/bin/ftb-test-ports.py {' '.join(specs)}"
                                 f" && for _ in $(seq 50); do [ $(ss -lntuH | wc -l) -ge {len(specs)} ] && exit 0;"
                                 " sleep 0.2; done; exit 1")
    assert started.returncode == 0, started.stdout + started.stderr


def stop_listeners(unit: str) -> None:
    docker_exec(NODE0, f"systemctl stop {unit}; systemctl reset-failed {unit}")


def loaded_table(host: str = NODE0) -> str:
    return docker_exec(host, "nft list table inet ftbundle").stdout


def loaded_digest(host: str = NODE0) -> str:
    match = re.search(r'comment "ftbundle ([0-9a-f]+)"', loaded_table(host))
    return match.group(1) if match else ""


def seen(source: str, proto: str, port: int) -> str:
    """"open" or "closed": node0's port as `source` ("controller" or "node1") reaches it."""
    if source == "controller":
        proc = subprocess.run([sys.executable, str(ASSETS / "probe.py"), ADDRESS0, proto, str(port)],
                              capture_output=True, text=True, timeout=60)
    else:
        proc = subprocess.run(["docker", "exec", "-i", NODE1, "python3", "-", ADDRESS0, proto, str(port)],
                              input=(ASSETS / "probe.py").read_text(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[0]


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_firewall_change_that_cuts_ssh_is_rolled_back_by_the_timer(scenario, tmp_path):
    """SSH that reaches node0 through a port forwarder on 45022 (inside the training range;
    `ss` names the forwarder, not sshd, and the live connection's own port is sshd's 22):
    opened to everyone with firewall_allowed_tcp_ports first, then a run over that very SSH
    connection without it. The role warns of the listener, loads the table (which now drops
    45022 from non-members, the controller among them), finds no new connection, says what
    happens next, and the systemd timer armed before the load puts back the previous table
    and file by itself. The run covers both hosts: node0 is the canary (`serial: [1, "100%"]`),
    so node1, reached on its own port 22 and fine, is not touched."""
    start_listeners("ftb-test-forward", "fwd:45022")
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ftb-test-rollback", "-f", str(key)],
                   check=True, timeout=60)
    for host in HOSTS:
        added = subprocess.run(["docker", "exec", "-i", host, "sh", "-c", "cat >> /root/.ssh/authorized_keys"],
                               input=(tmp_path / "id_ed25519.pub").read_text(), capture_output=True, text=True,
                               timeout=60)
        assert added.returncode == 0, added.stderr
    ssh_options = ["-o", "Port=45022", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]

    def ssh_through_forwarder() -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *ssh_options,
                               f"root@{ADDRESS0}", "echo $SSH_CONNECTION"], capture_output=True, text=True, timeout=60)

    try:
        opened = firewall_run(scenario, {"firewall_allowed_tcp_ports": [45022], "firewall_rollback_seconds": 40},
                              host=f"{NODE0},{NODE1}")
        assert opened.returncode == 0, tail(opened, 12000)
        reached = ssh_through_forwarder()
        # sshd sees the forwarder's connection from 127.0.0.1 to its own port 22, not 45022
        assert reached.returncode == 0 and reached.stdout.split()[2:] == ["127.0.0.1", "22"], reached
        digest, rules = loaded_digest(), docker_exec(NODE0, "cat /etc/ftbundle/firewall.nft").stdout
        assert "45022" in rules
        node1 = loaded_digest(NODE1), docker_exec(NODE1, "cat /etc/ftbundle/firewall.nft").stdout
        assert "45022" in node1[1]

        inventory = tmp_path / "over-ssh.yml"
        over_ssh = {"ansible_connection": "ssh", "ansible_user": "root", "ansible_ssh_private_key_file": str(key),
                    "ansible_ssh_common_args": " ".join(ssh_options[2:])}
        inventory.write_text(yaml.safe_dump({"all": {"hosts": {
            NODE0: dict(over_ssh, ansible_host=ADDRESS0, ansible_ssh_common_args=" ".join(ssh_options)),
            NODE1: dict(over_ssh, ansible_host=SCENARIO.addresses[1])}}}))  # node1: its sshd's own port 22
        started = time.monotonic()
        cut = run([str(BIN / "ansible-playbook"), "site.yml", "-i", f"{scenario.env['MOLECULE_EPHEMERAL_DIRECTORY']}/inventory",
                   "-i", str(inventory), "--tags", "firewall",
                   "-e", json.dumps({"firewall_rollback_seconds": 40})], env=scenario.env, timeout=600)
        failed_after = time.monotonic() - started
        said = " ".join(cut.stdout.split())
        assert cut.returncode != 0, tail(cut, 12000)
        assert "listening in the training range 32768-60999, closed to non-members from now on: 45022" in said, \
            tail(cut, 12000)
        assert re.search(r"Load the ruleset file\] \*+ (changed: \[\S+\] )*changed: \[" + re.escape(NODE0) + r"\]", said), \
            tail(cut, 12000)
        assert f"{NODE0}: no new SSH connection through the new firewall" in said, tail(cut, 12000)
        assert "restored by the rollback timer armed before the load, within firewall_rollback_seconds (40 s)" in said
        # the canary failed: node1 was not touched (its table and file as before, no timer armed)
        assert (loaded_digest(NODE1), docker_exec(NODE1, "cat /etc/ftbundle/firewall.nft").stdout) == node1
        assert docker_exec(NODE1, "systemctl is-active ftbundle-firewall-rollback.timer").stdout.strip() == "inactive"
        firewall_play = cut.stdout[cut.stdout.index("PLAY [Firewall - one host first"):cut.stdout.index("PLAY RECAP")]
        assert f"[{NODE1}]" not in firewall_play, firewall_play[-3000:]

        # the timer fires 40 s after the load; watch node0 until it has (a table is there throughout)
        watch = docker_exec(NODE0, f"""for _ in $(seq 900); do
            c=$(nft list table inet ftbundle 2>/dev/null | awk '$1 == "comment" {{print $3}}' | tr -d '"')
            [ -n "$c" ] || echo gap
            [ "$c" = "{digest}" ] && echo restored && exit 0
            sleep 0.1; done; echo timeout""")
        print(f"the play failed {failed_after:.0f}s after it started; rolled back {time.monotonic() - started:.0f}s"
              " after it started")
        assert watch.stdout.split() == ["restored"], watch.stdout
        assert docker_exec(NODE0, "cat /etc/ftbundle/firewall.nft").stdout == rules
        # within firewall_rollback_seconds of the load, as the role says (a systemd timer's default
        # AccuracySec of one minute made it fire 79 s after it was armed, not 40)
        journal = docker_exec(NODE0, "journalctl -o short-unix --no-pager | grep -e 'Started ftbundle-firewall-rollback.timer'"
                                     " -e 'firewall rolled back'").stdout
        armed = re.findall(r"^(\d+\.\d+) .*Started ftbundle-firewall-rollback\.timer", journal, re.M)
        fired = re.findall(r"^(\d+\.\d+) .*firewall rolled back: no fresh SSH connection after the change", journal, re.M)
        assert armed and fired, journal
        after = float(fired[-1]) - float(armed[-1])
        print(f"the rollback timer fired {after:.1f}s after it was armed")
        assert 40 <= after <= 45, journal
        assert docker_exec(NODE0, "systemctl is-active ftbundle-firewall-rollback.timer").stdout.strip() == "inactive"
        again = ssh_through_forwarder()
        assert again.returncode == 0, again
    finally:
        stop_listeners("ftb-test-forward")
        for host in HOSTS:
            docker_exec(host, "sed -i '/ftb-test-rollback$/d' /root/.ssh/authorized_keys")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_udp_ports_extra_rules_logged_drops_and_strict_mode_as_members_and_others_see_them(scenario):
    """Each verdict as a real packet sees it, from the controller (not a member) and from
    node1 (a member); every port said closed to one is seen open by the other, so a closed
    port is the firewall's doing, not a missing listener."""
    gateway = SCENARIO.gateway
    start_listeners("ftb-test-listen", "tcp:9100", "tcp:45000", "tcp:45001", "udp:9104", "udp:9105", "udp:9106")
    try:
        # compose (the default mode): only what training owns is closed, plus what these options add
        proc = firewall_run(scenario, {
            "firewall_members_udp_ports": [9104, 9106],
            "firewall_extra_rules": [{"source": f"{gateway}/32", "ports": [45001]},
                                     {"source": gateway, "ports": [9106], "proto": "udp"}],
            "firewall_log_dropped": True})
        assert proc.returncode == 0, tail(proc, 12000)
        expected = {
            ("controller", "tcp", 45000): "closed",  # the training range
            ("controller", "tcp", 45001): "open",  # ... but an extra rule for this source
            ("controller", "tcp", 9100): "open",  # not training's: the host's own verdict
            ("controller", "udp", 9104): "closed",  # a members-only UDP port
            ("controller", "udp", 9106): "open",  # ... with an extra rule for this source
            ("controller", "udp", 9105): "open",  # not training's
            ("node1", "tcp", 45000): "open",
            ("node1", "udp", 9104): "open",
        }
        assert {probe: seen(*probe) for probe in expected} == expected
        table = loaded_table()
        # the drop that met the controller's SYN to 45000 logged it (the log lines themselves go to
        # the kernel log of the host's network namespace; these test hosts are containers, whose
        # netfilter logging the kernel keeps off: net.netfilter.nf_log_all_netns=0)
        logged = re.search(r"tcp dport \{ [^}]*32768-60999 \} limit rate 10/minute (?:burst \d+ packets )?"
                           r'counter packets (\d+) bytes \d+ log prefix "ftbundle-drop: "', table)
        assert logged and int(logged.group(1)) >= 1, table
        assert re.search(r"udp dport \{ [^}]*9104[^}]* \} counter packets [1-9]\d* bytes \d+ drop", table), table

        # strict: members only; SSH, an allowed UDP port and a per-source rule excepted
        proc = firewall_run(scenario, {
            "firewall_mode": "strict",
            "firewall_allowed_udp_ports": [9105],
            "firewall_extra_rules": [{"source": gateway, "ports": [9100]}],
            "firewall_log_dropped": True})
        assert proc.returncode == 0, tail(proc, 12000)
        expected = {
            ("controller", "tcp", 22): "open",
            ("controller", "tcp", 9100): "open",  # the extra rule
            ("controller", "tcp", 45001): "closed",  # everything else
            ("controller", "udp", 9105): "open",  # allowed to everyone
            ("controller", "udp", 9106): "closed",
            ("node1", "tcp", 45001): "open",
            ("node1", "udp", 9106): "open",
        }
        assert {probe: seen(*probe) for probe in expected} == expected
        table = loaded_table()
        assert "policy drop;" in table, table
        logged = re.search(r'limit rate 10/minute (?:burst \d+ packets )?counter packets (\d+) bytes \d+ log prefix "ftbundle-drop: "',
                           table)
        assert logged and int(logged.group(1)) >= 1, table
    finally:
        stop_listeners("ftb-test-listen")
        restored = firewall_run(scenario, {})
        assert restored.returncode == 0, tail(restored, 12000)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_sshd_started_by_ssh_socket_inside_the_training_range_stays_reachable(scenario):
    """sshd started by ssh.socket on node1 (as Ubuntu 22.10 and later run it: systemd holds the
    listening socket, so `ss` names systemd, not sshd, and `sshd -T` knows nothing of the port),
    on 40022, inside the training range. The converged table drops it for the controller (not
    a member); after the role runs again, the controller reaches that sshd, and no warning
    calls it a service closed to non-members."""
    address1 = SCENARIO.addresses[1]
    set_up = docker_exec(NODE1, """set -e
        mkdir -p /etc/systemd/system/ssh.socket.d
        printf '[Socket]\\nListenStream=\\nListenStream=40022\\nAccept=yes\\n' > /etc/systemd/system/ssh.socket.d/ftb-test.conf
        printf '[Service]\\nExecStart=-/usr/sbin/sshd -i\\nStandardInput=socket\\n' > /etc/systemd/system/ssh@.service
        systemctl daemon-reload
        systemctl start ssh.socket
        ss -ltnpH | grep ':40022 .*"systemd"'""")
    assert set_up.returncode == 0, set_up.stdout + set_up.stderr

    def banner() -> str:
        try:
            with socket.create_connection((address1, 40022), timeout=3) as conn:
                return conn.recv(64).decode(errors="replace")
        except OSError as exc:
            return repr(exc)

    try:
        assert "timed out" in banner()  # the table as converged: the training range, closed to non-members
        proc = firewall_run(scenario, {"firewall_members_tcp_ports": [9201]}, host=NODE1)
        assert proc.returncode == 0, tail(proc, 12000)
        assert f"WARNING {NODE1}: listening in the training range" not in " ".join(proc.stdout.split()), \
            tail(proc, 12000)
        assert re.search(r"tcp dport \{ 22, 40022 \} accept", loaded_table(NODE1)), loaded_table(NODE1)
        assert banner().startswith("SSH-2.0-"), banner()
    finally:
        docker_exec(NODE1, "systemctl stop ssh.socket; rm -rf /etc/systemd/system/ssh.socket.d "
                           "/etc/systemd/system/ssh@.service; systemctl daemon-reload")
        restored = firewall_run(scenario, {}, host=NODE1)
        assert restored.returncode == 0, tail(restored, 12000)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_running_firewalld_is_refused_by_name_before_anything_changes(scenario):
    """firewalld (in the systemd test-host image, disabled) started on node1: its own table
    rejects what its zone does not allow, and in nftables a reject in any base chain is final,
    so ftbundle's accepts for the members would not hold. Starting it also stops
    nftables.service (firewalld.service says Conflicts=nftables.service) and with it
    ftbundle-firewall.service (PartOf=), whose stop deletes our table: seen here, and said in
    the role's README. A run then stops on node1 naming firewalld, loads nothing and leaves the
    rules file as it was; once firewalld is stopped, starting our unit brings the table back."""
    def ours() -> tuple[str, str]:
        return loaded_digest(NODE1), docker_exec(NODE1, "cat /etc/ftbundle/firewall.nft").stdout

    digest, rules = ours()
    assert digest, "node1 has no ftbundle table to begin with"
    started = docker_exec(NODE1, "systemctl start firewalld.service && firewall-cmd --state")
    assert started.stdout.strip() == "running", started.stdout + started.stderr
    try:
        assert ours() == ("", rules)  # firewalld's start stopped nftables.service, and ours with it
        assert docker_exec(NODE1, "systemctl is-active ftbundle-firewall.service").stdout.strip() == "inactive"
        proc = scenario("converge", "--", "--tags", "firewall", "--limit", NODE1,
                        "-e", json.dumps({"firewall_members_tcp_ports": [9200]}))
        said = " ".join(proc.stdout.split())
        assert proc.returncode != 0, tail(proc, 12000)
        assert f"{NODE1}: firewalld is running. It filters the same packets as ftbundle's nftables table" in said, \
            tail(proc, 12000)
        assert "Nothing was changed." in said
        assert ours() == ("", rules)
    finally:
        docker_exec(NODE1, "systemctl stop firewalld.service; systemctl start nftables.service ftbundle-firewall.service")
    assert ours() == (digest, rules)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_an_ipv6_nfs_server_is_bracketed_and_the_nccl_conf_block_can_be_turned_off(scenario):
    """node1 told that its NFS server is node0's IPv6 address: fstab says `[ADDR]:/srv/ftbundle`
    (unbracketed, `ADDR:/path` is ambiguous and mount.nfs reads it wrong). nccl_env_conf_block:
    false removes ftbundle's block from /etc/nccl.conf and keeps the administrator's lines."""
    server6 = SCENARIO.addresses6[0]
    admin = "NCCL_TOPO_FILE=/etc/admin-topology.xml"
    docker_exec(NODE1, f"echo {admin} >> /etc/nccl.conf")
    before = docker_exec(NODE1, "cat /etc/nccl.conf").stdout
    assert "# BEGIN ftbundle nccl_env" in before and admin in before, before
    # as on a host that has no line for /shared yet (an existing line for the path with another
    # source counts as the administrator's and is kept)
    docker_exec(NODE1, "sed -i '\\# /shared nfs #d' /etc/fstab")
    try:
        proc = scenario("converge", "--", "--tags", "nfs,nccl", "--limit", NODE1,
                        "-e", json.dumps({"nfs_client_server": server6, "nccl_env_conf_block": False}))
        assert proc.returncode == 0, tail(proc, 12000)
        fstab = docker_exec(NODE1, "cat /etc/fstab").stdout
        assert re.search(rf"^\[{re.escape(server6)}\]:/srv/ftbundle /shared nfs ", fstab, re.M), fstab
        conf = docker_exec(NODE1, "cat /etc/nccl.conf").stdout
        ours = re.search(r"# BEGIN ftbundle nccl_env\n.*?# END ftbundle nccl_env\n", before, re.S)
        assert ours and conf == before.replace(ours.group(0), ""), (before, conf)
    finally:
        docker_exec(NODE1, "sed -i '\\# /shared nfs #d' /etc/fstab")
        restored = scenario("converge", "--", "--tags", "nfs,nccl", "--limit", NODE1)
        assert restored.returncode == 0, tail(restored, 12000)
        docker_exec(NODE1, f"sed -i '\\#^{admin}$#d' /etc/nccl.conf")
