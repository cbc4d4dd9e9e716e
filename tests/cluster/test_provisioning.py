"""site.yml, for real: lint, then the Molecule scenario on three containerized hosts.

The hosts are Debian containers (the test-host image, built locally), each with its own
Docker engine inside; the training image is pushed to a real registry on this machine
(Debian's docker-registry, .ci/registry.sh) and pulled by digest by every host. Nothing
is pulled from the internet.

One Molecule cluster serves the whole module, in order: create + converge (the fixture),
--check on the converged hosts, verify, then the two halves together (`ftbundle run` with
the docker runtime on the hosts site.yml made ready), then the negative cases, which change
a host. A second full converge (Molecule's idempotence) is not run here: the lived-in
scenario runs it on the same three-host site.yml, every role included
(tests/cluster/test_provisioning_livedin.py), and the systemd one on systemd hosts; here it
cost a whole converge of site.yml (63 s on a quiet machine here) and showed nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import ASSETS, REPO, ftbundle, write_job
from tests.support.testbed import checkout_testbed, ensure_registry

BIN = Path(sys.executable).parent
# this checkout's names and addresses for the scenario (tests/support/testbed.py; slot 0: ftb-mol-node0..2,
# 198.18.250.11-13, the registry on :5000)
TESTBED = checkout_testbed()
SCENARIO = TESTBED.default
HOSTS = SCENARIO.hosts
ADDRESSES = SCENARIO.addresses
REGISTRY = f"{SCENARIO.gateway}:{TESTBED.registry_port}"  # the controller's registry, as the hosts reach it


def run(argv: list[str], *, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def tail(proc: subprocess.CompletedProcess, n: int = 6000) -> str:
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout[-n:]}\n--- stderr ---\n{proc.stderr[-n:]}"


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines -> {host: {ok: n, changed: n, failed: n, ...}}."""
    hosts = {}
    for line in output.split("PLAY RECAP", 1)[-1].splitlines():
        match = re.match(r"^(\S+)\s+:\s+(ok=\d+.*)$", line.strip())  # (not a profiling callback's lines)
        if match:
            hosts[match.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(2))}
    return hosts


def docker_exec(host: str, command: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", "exec", host, "bash", "-c", command], capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, f"{host}: {command}\n{tail(proc)}"
    return proc


# ---------------------------------------------------------------------------------------
# The Molecule cluster


class Molecule:
    """`molecule <command>` for the default scenario, with the test's environment."""

    def __init__(self, env: dict[str, str], workdir: Path, image: str):
        self.env = env
        self.workdir = workdir
        self.image = image  # the pinned reference every host must hold
        self.repo = image.split("@")[0]

    def __call__(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
        return run([str(BIN / "molecule"), *args], env=self.env, timeout=timeout)


@pytest.fixture(scope="module")
def molecule(testhost_image) -> Molecule:
    """site.yml converged on three fresh containerized hosts; destroyed afterwards."""
    pushed = run(["bash", ".ci/registry.sh"], env=dict(os.environ, **TESTBED.script_env()), timeout=1200)
    assert pushed.returncode == 0, tail(pushed)
    image = f"{REGISTRY}/{pushed.stdout.strip().splitlines()[-1]}"
    workdir = Path(tempfile.mkdtemp(prefix="ftb-molecule-", dir="/tmp"))
    (workdir / "shared").mkdir()
    env = dict(os.environ, FTB_TESTHOST_IMAGE=testhost_image, FTB_MOLECULE_IMAGE=image,
               FTB_MOLECULE_WORKDIR=str(workdir), PATH=f"{BIN}:{os.environ['PATH']}",
               ANSIBLE_FORCE_COLOR="0", PY_COLORS="0", **TESTBED.molecule_env(SCENARIO, workdir / "state"))
    mol = Molecule(env, workdir, image)
    # debris of an earlier, interrupted session of this checkout (names are per checkout:
    # tests/support/testbed.py)
    SCENARIO.remove()
    try:
        created = mol("create")
        assert created.returncode == 0, tail(created)
        started = time.monotonic()
        converged = mol("converge", "--", "--diff")  # --diff: the cluster's private key must not show
        took = time.monotonic() - started
        assert converged.returncode == 0, tail(converged, 12000)
        assert "PRIVATE KEY" not in converged.stdout + converged.stderr
        assert "+++ after: /root/.ssh/config" in converged.stdout  # --diff did print diffs
        hosts = recap(converged.stdout)
        assert sorted(hosts) == HOSTS and all(h["failed"] == 0 for h in hosts.values()), converged.stdout[-3000:]
        print(f"converge of site.yml on 3 fresh hosts: {took:.0f}s")
        yield mol
    finally:
        SCENARIO.remove()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(autouse=True)
def registry_alive() -> None:
    """Each test finds the controller's registry answering (started again if it died since
    the module's converge: a pull by digest would otherwise fail for a reason no role has)."""
    ensure_registry(TESTBED.registry_port, **TESTBED.script_env())


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_check_mode_reports_drift_and_changes_nothing(molecule):
    """--check on the converged cluster: nothing to do. After a file goes missing on one
    host, --check names that host as changed and still leaves the file missing. (The drift
    run is limited to the role that owns the file: the full --check run before it already
    shows every other role reports nothing on an unchanged host; a second full run would
    repeat that at the cost of a whole --check of site.yml.)"""
    clean = molecule("converge", "--", "--check")
    assert clean.returncode == 0, tail(clean, 12000)
    assert all(h["changed"] == 0 and h["failed"] == 0 for h in recap(clean.stdout).values()), clean.stdout[-3000:]

    docker_exec(HOSTS[1], "rm /etc/ftbundle/nccl.env")
    try:
        drift = molecule("converge", "--", "--check", "--tags", "nccl")
        assert drift.returncode == 0, tail(drift, 12000)
        hosts = recap(drift.stdout)
        assert hosts[HOSTS[1]]["changed"] >= 1 and hosts[HOSTS[0]]["changed"] == hosts[HOSTS[2]]["changed"] == 0, \
            drift.stdout[-3000:]
        assert docker_exec(HOSTS[1], "test -e /etc/ftbundle/nccl.env", check=False).returncode != 0
    finally:
        restored = molecule("converge", "--", "--tags", "nccl")
        assert restored.returncode == 0, tail(restored)
    assert "NCCL_SOCKET_IFNAME==eth0" in docker_exec(HOSTS[1], "cat /etc/ftbundle/nccl.env").stdout


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_verify_real_effects(molecule):
    """molecule/default/verify.yml: SSH between every pair, the firewall from inside and
    outside, NCCL env, fstab, exports, the image by digest with one ID everywhere."""
    proc = molecule("verify")
    assert proc.returncode == 0, tail(proc, 12000)
    hosts = recap(proc.stdout)
    assert sorted(hosts) == HOSTS and all(h["failed"] == 0 for h in hosts.values()), proc.stdout[-3000:]


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_ftbundle_runs_on_the_pinned_image_site_yml_made_ready(molecule, tmp_path):
    """The halves together: the cluster key and known_hosts that site.yml made let the
    launcher in with strict host key checking; every rank runs in the pinned image, reads
    the NCCL env file, and all six all-reduce over gloo across the three hosts."""
    key = molecule.workdir / "ssh" / "id_ed25519_ftbundle"
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(docker_exec(HOSTS[0], "cat /etc/ssh/ssh_known_hosts").stdout)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(key),
                 "ansible_ssh_common_args": f"-o UserKnownHostsFile={known_hosts}"},
        "children": {"trainers": {"hosts": {
            f"node{i}": {"ansible_host": address} for i, address in enumerate(ADDRESSES)}}}}}))
    shutil.copy(ASSETS / "allreduce.py", molecule.workdir / "shared" / "allreduce.py")
    job = write_job(tmp_path / "job.yaml", {
        "name": "halves", "inventory": str(inventory), "hosts": "trainers", "nproc_per_node": 2,
        "master_port": 29500, "shared_dir": "/shared",
        "env": {"OMP_NUM_THREADS": "1"},
        # no image in the job or the inventory: the digest site.yml recorded in /etc/ftbundle/image.ref
        "runtime": {"kind": "docker"},
        "train": {"script": "/shared/allreduce.py", "args": ["--steps", "5", "--sleep", "0.1"]},
    })

    recorded = docker_exec(HOSTS[0], "cat /etc/ftbundle/image.ref").stdout.strip()
    assert recorded == molecule.image
    check = ftbundle("check", str(job), timeout=300)
    assert check.returncode == 0, tail(check)
    image_id = docker_exec(HOSTS[0], f"docker image inspect -f '{{{{.Id}}}}' {recorded}").stdout.strip()
    # same digest and ID, and the packages inside it (read by a run of the image's python3)
    assert re.search(rf"{re.escape(recorded)} \(ID {image_id}\) python=3\.11\.\d+ torch=2\.13\.0\S* "
                     r"transformers=absent llamafactory=absent: node\[0-2\]", check.stdout), check.stdout

    proc = ftbundle("run", "-v", str(job), timeout=600)  # -v: rank 0's raw output on stdout
    assert proc.returncode == 0, tail(proc)
    assert "check passed: 3 host(s)" in proc.stderr, proc.stderr

    runs = molecule.workdir / "shared" / "runs"
    [run_dir] = [p for p in runs.iterdir() if p.name.startswith("halves-")]
    plan = json.loads((run_dir / "plan.json").read_text())
    for node in plan["nodes"]:
        argv = node["argv"]
        assert argv[:2] == ["docker", "run"] and molecule.image in argv, argv
        assert ["--env-file", "/etc/ftbundle/nccl.env"] == argv[argv.index("--env-file"):argv.index("--env-file") + 2]
    logs = "".join((run_dir / f"node-{r}-node{r}.a1.log").read_text() for r in range(3))
    # local rank 1 of each node writes to files of its own under ranks/ (torchrun --redirects)
    logs += "".join(f.read_text() for f in sorted((run_dir / "ranks").rglob("*.log")))
    for rank in range(6):
        # every rank ran inside the container with the env file site.yml wrote
        # (NCCL_TIMEOUT is read by neither NCCL nor torch: site.yml no longer sets it)
        assert re.search(rf"rank {rank} of world size 6 on node\d .*NCCL_SOCKET_IFNAME==eth0 "
                         rf"GLOO_SOCKET_IFNAME=eth0 NCCL_TIMEOUT=$", logs, re.MULTILINE), logs[-3000:]
        assert f"rank {rank} done" in logs
    assert "[node0 r0] step 4 allreduce ok" in proc.stdout, proc.stdout[-2000:]
    # nothing of the job is left on any host: no container, no process
    for host in HOSTS:
        assert docker_exec(host, "docker ps -q --filter name=ftb-halves").stdout.strip() == ""


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_host_whose_image_differs_fails_verify_naming_it(molecule):
    """The mutable-tag trap the pinning avoids: a tag that names another image on node2.
    The verify play groups hosts by image ID and fails once, naming node2."""
    drift = f"{molecule.repo}:drift"
    for host in HOSTS[:2]:
        docker_exec(host, f"docker tag {molecule.image} {drift}")
    docker_exec(HOSTS[2], f"printf 'FROM {molecule.image}\\nLABEL org.ftbundle.test=drift\\n' | "
                          f"DOCKER_BUILDKIT=0 docker build -q -t {drift} -")
    try:
        proc = molecule("converge", "--", "--tags", "verify", "-e", f"verify_image={drift}")
        assert proc.returncode != 0, tail(proc)
        out = proc.stdout
        assert "image ID differs:" in out, tail(proc, 12000)
        ids = {host: docker_exec(host, f"docker image inspect -f '{{{{.Id}}}}' {drift}").stdout.strip()
               for host in HOSTS}
        assert ids[HOSTS[0]] == ids[HOSTS[1]] != ids[HOSTS[2]]
        assert f"{ids[HOSTS[0]]}: {HOSTS[0]}, {HOSTS[1]}" in out, tail(proc, 12000)
        assert f"{ids[HOSTS[2]]}: {HOSTS[2]}" in out, tail(proc, 12000)
        # the software inside the images is still alike: only the image ID is reported
        assert "software in the image differs" not in out
    finally:
        for host in HOSTS:
            docker_exec(host, f"docker rmi {drift}", check=False)


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra, message", [
    ('{"ftb_node_rank": 0}', "ftb_node_rank must be set on all trainers or none, numbering them 0..2 once each; "
                             "got [0, 0, 0]"),
    ('{"ftb_shared_dir": ""}', f"{HOSTS[0]}: variable 'ftb_shared_dir' is not set"),
    ('{"preflight_training_group": "gpus"}', "inventory group 'gpus' is missing or empty"),
])
def test_preflight_refuses_a_bad_inventory_before_anything_changes(molecule, extra, message):
    proc = molecule("converge", "--", "-e", extra)
    assert proc.returncode != 0, tail(proc)
    assert message in proc.stdout, tail(proc, 12000)
    assert "PLAY [NFS server" not in proc.stdout  # stopped in the first play
    assert all(h.get("changed", 0) == 0 for h in recap(proc.stdout).values()), proc.stdout[-3000:]


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_tag_is_refused_before_anything_changes_unless_resolved_once(molecule):
    tag = f"{molecule.repo}:{run(['bash', '.ci/train-image.sh']).stdout.strip().split(':')[-1]}"
    before = {host: docker_exec(host, "cat /etc/ftbundle/image.ref").stdout for host in HOSTS}

    refused = molecule("converge", "--", "-e", f"ftb_image={tag}")
    assert refused.returncode != 0, tail(refused)
    assert f"ftb_image '{tag}' is not pinned by digest" in refused.stdout, tail(refused, 12000)
    assert "ftb_image_resolve_tag: true" in refused.stdout
    # the preflight failed before any play changed a host
    assert all(h.get("changed", 0) == 0 for h in recap(refused.stdout).values()), refused.stdout[-3000:]
    assert {host: docker_exec(host, "cat /etc/ftbundle/image.ref").stdout for host in HOSTS} == before

    # asked to, the controller resolves the tag once through the registry's API; every
    # host then pulls and records the same digest: the one the registry has for the tag
    resolved = molecule("converge", "--", "--tags", "preflight,image", "-e", f"ftb_image={tag}",
                        "-e", "ftb_image_resolve_tag=true", "-e", "training_image_registry_scheme=http")
    assert resolved.returncode == 0, tail(resolved, 12000)
    refs = {host: docker_exec(host, "cat /etc/ftbundle/image.ref").stdout.strip() for host in HOSTS}
    assert set(refs.values()) == {molecule.image}, refs


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_air_gapped_tarball_is_loaded_and_pinned_by_image_id(molecule, tmp_path):
    """No registry: a `docker save` tarball from the controller is loaded on every host.
    A loaded image has no registry digest, so it is pinned by its image ID."""
    context = tmp_path / "context"
    context.mkdir()
    (context / "hello").write_text("offline\n")
    (context / "Dockerfile").write_text("FROM scratch\nCOPY hello /hello\n")
    built = subprocess.run(["docker", "build", "-q", "-t", "ftbundle-offline:test", str(context)],
                           capture_output=True, text=True, env=dict(os.environ, DOCKER_BUILDKIT="0"))
    assert built.returncode == 0, built.stderr
    image_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", "ftbundle-offline:test"],
                              capture_output=True, text=True, check=True).stdout.strip()
    tarball = tmp_path / "offline.tar"
    subprocess.run(["docker", "save", "-o", str(tarball), "ftbundle-offline:test"], check=True)
    subprocess.run(["docker", "rmi", "ftbundle-offline:test"], capture_output=True)

    # a digest reference cannot name a loaded image: refused with what to use instead
    wrong = molecule("converge", "--", "--tags", "image", "-e", f"ftb_image_tarball={tarball}")
    assert wrong.returncode != 0, tail(wrong)
    assert "ftb_image must be the image ID" in wrong.stdout, tail(wrong, 12000)

    args = ("converge", "--", "--tags", "image", "-e", f"ftb_image={image_id}", "-e", f"ftb_image_tarball={tarball}")
    loaded = molecule(*args)
    assert loaded.returncode == 0, tail(loaded, 12000)
    for host in HOSTS:
        assert docker_exec(host, f"docker image inspect -f '{{{{.Id}}}}' {image_id}").stdout.strip() == image_id
        assert docker_exec(host, "cat /etc/ftbundle/image.ref").stdout.strip() == image_id
        assert docker_exec(host, "ls /var/tmp/ftbundle-image.tar", check=False).returncode != 0  # no copy left
    again = molecule(*args)  # present everywhere: nothing copied or loaded twice
    assert again.returncode == 0, tail(again, 12000)
    assert all(h["changed"] == 0 for h in recap(again.stdout).values()), again.stdout[-3000:]


# ---------------------------------------------------------------------------------------
# What site.yml refuses, keeps and never does on hosts that already run things


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("clients", ["[]", f'["{ADDRESSES[1]}", "*"]'])
def test_nfs_export_refuses_an_empty_or_open_client_list(molecule, clients):
    before = docker_exec(HOSTS[0], "cat /etc/exports.d/ftbundle.exports").stdout
    proc = molecule("converge", "--", "--tags", "nfs", "-e", f'{{"nfs_server_clients": {clients}}}')
    assert proc.returncode != 0, tail(proc)
    assert "lets every host on the network mount /srv/ftbundle" in proc.stdout, tail(proc, 12000)
    assert docker_exec(HOSTS[0], "cat /etc/exports.d/ftbundle.exports").stdout == before


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_an_administrators_fstab_entry_is_refused_or_kept_and_verify_names_the_odd_host(molecule):
    """node2's fstab already mounts a filer at /shared. refuse: stop, naming the line, fstab
    untouched. keep (default): the line stays; verify then reports that node2 mounts
    another export than the others."""
    theirs = "filer.example.com:/vol/ml /shared nfs defaults 0 0"
    original = docker_exec(HOSTS[2], "cat /etc/fstab").stdout
    docker_exec(HOSTS[2], f"sed -i '\\# /shared #d' /etc/fstab && echo '{theirs}' >> /etc/fstab")
    try:
        refused = molecule("converge", "--", "--tags", "nfs", "-e", "nfs_client_existing_fstab=refuse")
        assert refused.returncode != 0, tail(refused)
        assert f"/etc/fstab already mounts something at /shared: '{theirs}'" in refused.stdout, tail(refused, 12000)
        assert theirs in docker_exec(HOSTS[2], "cat /etc/fstab").stdout

        kept = molecule("converge", "--", "--tags", "nfs")
        assert kept.returncode == 0, tail(kept, 12000)
        fstab = docker_exec(HOSTS[2], "cat /etc/fstab").stdout
        assert theirs in fstab and f"{ADDRESSES[0]}:/srv/ftbundle" not in fstab, fstab

        verify = molecule("converge", "--", "--tags", "verify")
        assert verify.returncode != 0, tail(verify)
        assert "shared storage (fstab; mounted) differs:" in verify.stdout, tail(verify, 12000)
        assert re.search(rf"fstab: filer\.example\.com:/vol/ml nfs; mounted: .*: {HOSTS[2]}", verify.stdout), \
            tail(verify, 12000)
    finally:
        docker_exec(HOSTS[2], f"cat > /etc/fstab <<'EOF'\n{original}EOF")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_ftbundles_own_fstab_line_follows_a_moved_nfs_server_and_a_share_mounted_from_the_old_one_is_named(molecule):
    """The NFS server moves (nfs_client_server changes): ftbundle's own fstab line, recorded in
    /etc/ftbundle/nfs_client.fstab when written, is replaced on every host, not kept as an
    administrator's. A share still mounted from the former server is not unmounted under its
    users: the run stops on that host, naming both sources and what to do."""
    old_source = f"{ADDRESSES[0]}:/srv/ftbundle"
    moved = SCENARIO.gateway.rsplit(".", 1)[0] + ".99"  # the new server's address (no host answers there)
    options = "rw,hard,_netdev,nofail,vers=4.2"
    for host in HOSTS:
        assert docker_exec(host, "cat /etc/ftbundle/nfs_client.fstab").stdout == f"{old_source} /shared nfs {options}\n"
    try:
        proc = molecule("converge", "--", "--tags", "nfs", "-e", f"nfs_client_server={moved}")
        assert proc.returncode == 0, tail(proc, 12000)
        assert "keeping the administrator's fstab entry" not in proc.stdout, tail(proc, 12000)
        for host in HOSTS:
            assert f"{host}: ftbundle's fstab line for /shared named {old_source}; it now names {moved}:/srv/ftbundle" \
                in proc.stdout, tail(proc, 12000)
            lines = [line.split() for line in docker_exec(host, "cat /etc/fstab").stdout.splitlines()
                     if not line.startswith("#") and line.split()[1:2] == ["/shared"]]
            assert lines == [[f"{moved}:/srv/ftbundle", "/shared", "nfs", options, "0", "0"]], lines
            assert docker_exec(host, "cat /etc/ftbundle/nfs_client.fstab").stdout.split()[0] == f"{moved}:/srv/ftbundle"

        # node2 still has the share of the former server mounted (a tmpfs named like it: no NFS
        # client in this kernel): the run with mounting on stops there and says why. The new server
        # answers on TCP 2049 (node1 stands in for it: preflight refuses a server site.yml does not
        # start that does not answer, before any role runs)
        docker_exec(HOSTS[2], f"mount -t tmpfs {old_source} /shared")
        docker_exec(HOSTS[1], "setsid nohup python3 -c 'import socket, time; s = socket.socket(); "
                              "s.bind((\"0.0.0.0\", 2049)); s.listen(8); time.sleep(600)' ftb-fake-nfsd "
                              ">/dev/null 2>&1 </dev/null &")
        mounted = molecule("converge", "--", "--tags", "nfs", "--limit", HOSTS[2],
                           "-e", json.dumps({"nfs_client_server": ADDRESSES[1], "nfs_client_mount": True,
                                             "nfs_client_wait_timeout": 5}))
        moved_source = f"{ADDRESSES[1]}:/srv/ftbundle"
        assert mounted.returncode != 0, tail(mounted)
        assert (f"{HOSTS[2]}: /shared is mounted from {old_source}; ftbundle's fstab line says {moved_source}. "
                "When no job uses the share, run `umount /shared`") in mounted.stdout, tail(mounted, 12000)
        assert "Wait for the server's NFS port" not in mounted.stdout.split("Refuse to switch")[-1], tail(mounted, 12000)
        # still mounted (on top of the scenario's own bind mount of the shared directory)
        assert docker_exec(HOSTS[2], "findmnt -n -o SOURCE --mountpoint /shared").stdout.split()[-1] == old_source
    finally:
        docker_exec(HOSTS[2], "umount /shared", check=False)
        docker_exec(HOSTS[1], "pkill -f [f]tb-fake-nfsd", check=False)  # ([f]: not this shell itself)
        back = molecule("converge", "--", "--tags", "nfs")  # moved back: the recorded line is ours again
        assert back.returncode == 0, tail(back, 12000)
    for host in HOSTS:
        assert f"{old_source} /shared nfs {options} 0 0" in docker_exec(host, "cat /etc/fstab").stdout
        assert f"{moved}:" not in docker_exec(host, "cat /etc/fstab").stdout


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_verify_never_pulls_and_names_a_host_missing_the_recorded_image(molecule):
    # the recorded reference is the registry image again (the tarball test above records its own)
    pinned = molecule("converge", "--", "--tags", "image")
    assert pinned.returncode == 0, tail(pinned, 12000)
    assert docker_exec(HOSTS[1], "cat /etc/ftbundle/image.ref").stdout == molecule.image + "\n"
    docker_exec(HOSTS[1], f"docker image rm {molecule.image}")
    try:
        proc = molecule("converge", "--", "--tags", "verify")
        assert proc.returncode != 0, tail(proc)
        assert "image ID differs:" in proc.stdout and f"image missing: {HOSTS[1]}" in proc.stdout, tail(proc, 12000)
        # verify ran the image with --pull=never: node1 still does not have it
        assert docker_exec(HOSTS[1], f"docker image inspect {molecule.image}", check=False).returncode != 0
    finally:
        restored = molecule("converge", "--", "--tags", "image")
        assert restored.returncode == 0, tail(restored, 12000)


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_rotated_cluster_key_replaces_the_old_one_everywhere(molecule):
    keys = molecule.workdir / "ssh"
    old = (keys / "id_ed25519_ftbundle.pub").read_text().split()[1]
    shutil.rmtree(keys)  # rotation: a new keypair on the next run
    proc = molecule("converge", "--", "--tags", "ssh", "--diff")
    assert proc.returncode == 0, tail(proc, 12000)
    assert "PRIVATE KEY" not in proc.stdout + proc.stderr
    new = (keys / "id_ed25519_ftbundle.pub").read_text().split()[1]
    assert new != old
    for host in HOSTS:
        authorized = docker_exec(host, "cat /root/.ssh/authorized_keys").stdout
        assert new in authorized and old not in authorized, authorized
    # the mesh works on the new key, strict host keys still on
    out = docker_exec(HOSTS[0], f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {HOSTS[2]} hostname").stdout
    assert out.strip() == "node2"


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_an_active_ufw_stops_the_firewall_role_before_it_changes_anything(molecule):
    """ufw (Debian's package, installed and enabled on node2 for this test) filters the
    same packets: the role stops with a message instead of adding a table behind it."""
    installed = docker_exec(HOSTS[2], "DEBIAN_FRONTEND=noninteractive apt-get install -y -q ufw", check=False)
    if installed.returncode != 0:
        installed = docker_exec(HOSTS[2], "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q ufw")
    docker_exec(HOSTS[2], "ufw allow 22/tcp && ufw --force enable")
    rules = docker_exec(HOSTS[2], "cat /etc/ftbundle/firewall.nft").stdout
    try:
        proc = molecule("converge", "--", "--tags", "firewall", "--limit", HOSTS[2],
                        "-e", '{"firewall_extra_cluster_addresses": ["198.18.251.7"]}')
        assert proc.returncode != 0, tail(proc)
        assert f"{HOSTS[2]}: ufw is active." in proc.stdout and "Nothing was changed" in proc.stdout, tail(proc, 12000)
        assert docker_exec(HOSTS[2], "cat /etc/ftbundle/firewall.nft").stdout == rules
    finally:
        docker_exec(HOSTS[2], "ufw --force disable && DEBIAN_FRONTEND=noninteractive apt-get purge -y -q ufw", check=False)
