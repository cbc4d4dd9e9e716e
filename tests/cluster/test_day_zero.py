"""Day zero (issue 35): from `ftbundle init` to a finished run on two fresh servers, as a
newcomer walks it with the README alone, every message on the way naming its fix.

The servers are two fresh containerized hosts (sshd, Debian's docker.io installed but not
running, no systemd: what tests/support/cluster.py makes, with what a nested Docker engine needs).
The training image is the CPU image with LlamaFactory (.ci/train-lf-image.sh), pushed to a
real registry on this machine served over plain HTTP, as a cluster-local registry often is.
The walk, command by command, is docs/quickstart-servers.md; each step's time is printed
(`-s` shows them) and recorded there.

What the test adds to the inventory beyond the documented placeholders is what these test
hosts need and a real server would not: the controller's key and known_hosts for SSH, and
`nfs_client_mount: false` (this kernel has no NFS: the shared directory is a bind mount at
the same path on every host, as in the Molecule scenarios).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.helpers import REPO, place_tiny_model
from tests.cluster.test_docker_runtime_faults import DOCKER_INSIDE
from tests.support.testbed import checkout_testbed, ensure_registry

pytestmark = [pytest.mark.cluster, pytest.mark.train]

BIN = Path(sys.executable).parent
TESTBED = checkout_testbed()


class Walk:
    """The newcomer's shell: commands run from the project directory `init` wrote, timed."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.times: list[tuple[str, float]] = []
        self.provision: tuple[str, Path] | None = None  # the site.yml command init printed, and where

    def __call__(self, label: str, argv: list[str], timeout: float = 900,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
        started = time.monotonic()
        # no ANSIBLE_CONFIG of the test's own: the project's ansible.cfg is read only as init's command says
        proc = subprocess.run(argv, cwd=cwd or self.cwd, capture_output=True, text=True, timeout=timeout,
                              env={"PATH": f"{BIN}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(self.cwd),
                                   "ANSIBLE_FORCE_COLOR": "0", "LANG": "C.UTF-8"})
        took = time.monotonic() - started
        self.times.append((label, took))
        print(f"day zero: {label}: {took:.1f} s (exit {proc.returncode})")
        return proc

    def ftbundle(self, label: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return self(label, [str(BIN / "ftbundle"), *args], timeout=timeout)

    def site(self, label: str) -> subprocess.CompletedProcess:
        """The site.yml command exactly as `init` printed it."""
        assert self.provision is not None, "init printed no site.yml command"
        command, where = self.provision
        return self(label, ["bash", "-c", command], timeout=1800, cwd=where)


def out(proc: subprocess.CompletedProcess, n: int = 6000) -> str:
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout[-n:]}\n--- stderr ---\n{proc.stderr[-n:]}"


def fill(path: Path, placeholder: str, value: str) -> None:
    """Uncomment a FILL IN line of the inventory and put the value: what the newcomer does."""
    text = path.read_text()
    pattern = re.compile(rf"^(\s*)# {re.escape(placeholder)}:.*$", re.MULTILINE)
    assert pattern.search(text), f"no placeholder '# {placeholder}:' in\n{text}"
    path.write_text(pattern.sub(lambda m: f"{m.group(1)}{placeholder}: {value}", text, count=1))


def add_var(path: Path, line: str) -> None:
    """A line under all.vars (after `  vars:`)."""
    text = path.read_text()
    path.write_text(text.replace("\n  vars:\n", f"\n  vars:\n    {line}\n", 1))


@pytest.fixture(scope="module")
def servers(testhost_image):
    work = Path(tempfile.mkdtemp(prefix="ftb-dayzero-", dir="/tmp"))
    try:
        with Cluster(2, name_prefix="ftb-day0", shared_dir=work / "shared", image=testhost_image,
                     docker_args=DOCKER_INSIDE) as cluster:
            yield cluster, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.timeout(3600)
def test_a_newcomer_gets_from_init_to_a_finished_run_on_two_fresh_servers(servers):
    cluster, work = servers
    ensure_registry(TESTBED.registry_port, **TESTBED.script_env())
    pushed = subprocess.run(["bash", ".ci/registry.sh", ".ci/train-lf-image.sh"], cwd=REPO, capture_output=True,
                            text=True, timeout=1800, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
                                                          **TESTBED.script_env()})
    assert pushed.returncode == 0, out(pushed)
    registry = f"{cluster.subnet.network_address + 1}:{TESTBED.registry_port}"  # this machine, as the hosts see it
    image = f"{registry}/{pushed.stdout.strip().splitlines()[-1]}"
    shared = cluster.shared_dir / "ftbundle"
    node0, node1 = (h.ip for h in cluster.hosts)

    project = work / "project"
    walk = Walk(work)
    # 1. init: a CPU job (these servers have no GPU), the model a path on the shared storage
    proc = walk.ftbundle("ftbundle init", "init", "--dir", str(project), "--hosts", f"{node0},{node1}",
                         "--gpus", "0", "--model", f"{shared}/tiny-llama", "--shared-dir", str(shared), "--yes")
    assert proc.returncode == 0, out(proc)
    assert "fill in the lines marked FILL IN" in proc.stdout and "docs/quickstart-servers.md" in proc.stdout
    assert f"copy it to {shared}/data" in proc.stdout, out(proc)
    # the next step's command, as printed: from outside the checkout it names the checkout's
    # site.yml and ansible.cfg (without it, Ansible's defaults: interpreter warnings, 5 forks)
    (command,) = [line.strip() for line in proc.stdout.splitlines() if "ansible-playbook" in line]
    assert command == (f"ANSIBLE_CONFIG={REPO / 'ansible.cfg'} ansible-playbook {REPO / 'site.yml'} "
                       "-i project/inventory.yml"), proc.stdout
    walk.provision = (command, work)
    assert "ftbundle check project/job.yaml" in proc.stdout and "ftbundle run project/job.yaml" in proc.stdout
    inventory = project / "inventory.yml"
    # what only a test host needs (see the module's docstring)
    add_var(inventory, f"ansible_ssh_private_key_file: {cluster.key_file}")
    add_var(inventory, f"ansible_ssh_common_args: -o UserKnownHostsFile={cluster.known_hosts}")
    add_var(inventory, "nfs_client_mount: false")

    # 2. site.yml before the placeholders are filled: refused, naming each variable and where
    proc = walk.site("site.yml, placeholders not filled")
    assert proc.returncode != 0, out(proc)
    for var in ("ftb_image", "ftb_training_user"):
        assert f"variable '{var}' is not set" in proc.stdout, out(proc)
    assert "FILL IN" in proc.stdout and "docs/provisioning.md#the-inventory" in proc.stdout, out(proc)
    assert "changed=0" in proc.stdout and "changed=1" not in proc.stdout, out(proc)

    # 3. the placeholders filled; the NFS server is node0
    fill(inventory, "ansible_user", "root")
    fill(inventory, "ftb_training_user", "root")
    fill(inventory, "ftb_image", image)
    fill(inventory, node0, "{}")
    proc = walk.site("site.yml, NFS server without systemd")
    assert proc.returncode != 0, out(proc)
    assert "has no systemd" in proc.stdout and "nfs_server_manage_service: false" in proc.stdout, out(proc)
    assert "docs/provisioning.md#hosts-without-systemd-or-a-kernel-nfs" in proc.stdout, out(proc)
    assert "Failed to find required executable" not in proc.stdout, out(proc)

    # 4. as the message says (this kernel has no nfsd either): the exports are written, not served
    add_var(inventory, "nfs_server_manage_service: false")
    proc = walk.site("site.yml, Docker engine not running")
    assert proc.returncode != 0, out(proc)
    assert "its Docker engine does not answer" in proc.stdout and "start dockerd" in proc.stdout, out(proc)
    assert "Cannot connect to the Docker daemon" in proc.stdout, out(proc)
    assert "executing" not in proc.stdout and "nil pointer" not in proc.stdout, out(proc)  # no Go template error

    # 5. as the message says: the engine started with the host's own means (no systemd here)
    started = time.monotonic()
    for host in cluster.hosts:
        cluster.exec(host, "setsid nohup dockerd >/var/log/dockerd.log 2>&1 </dev/null &")
    for host in cluster.hosts:
        while cluster.exec(host, "docker info >/dev/null 2>&1", check=False).returncode != 0:
            assert time.monotonic() - started < 120, cluster.exec(host, "tail /var/log/dockerd.log").stdout
            time.sleep(0.5)
    walk.times.append(("dockerd started on both", time.monotonic() - started))
    proc = walk.site("site.yml, plain-HTTP registry")
    assert proc.returncode != 0, out(proc)
    assert f"the registry {registry} of ftb_image answers over plain HTTP" in proc.stdout, out(proc)
    assert f'container_runtime_insecure_registries: ["{registry}"]' in proc.stdout, out(proc)
    assert "server gave HTTP response to HTTPS client" in proc.stdout  # what docker would have said, explained

    # 6. as the message says
    fill(inventory, "container_runtime_insecure_registries", f'["{registry}"]')
    proc = walk.site("site.yml")
    assert proc.returncode == 0, out(proc, 12000)
    assert "failed=0" in proc.stdout and "all 2 hosts alike" in proc.stdout, out(proc)
    # the project's ansible.cfg was read (interpreter_python = auto_silent): no warning per host
    assert "discovered Python interpreter" not in proc.stdout + proc.stderr, out(proc)

    # 7. the data and the model on the shared storage, as init said
    shutil.copytree(project / "data", shared / "data")
    place_tiny_model(shared / "tiny-llama")

    # 8. check: the image's LlamaFactory shown beside torch, everything passes
    proc = walk.ftbundle("ftbundle check", "check", "project/job.yaml", timeout=600)
    assert proc.returncode == 0, out(proc)
    assert re.search(r"image\s+.*train-lf@sha256:[0-9a-f]{64} \(ID sha256:[0-9a-f]+\) python=3\.11\.\d+ "
                     r"torch=2\.13\.0\S* transformers=\S+ llamafactory=0\.9\.5", proc.stdout), out(proc)

    # 9. run: a real LoRA on the CPU, 2 servers x 1 rank, in the pinned image
    proc = walk.ftbundle("ftbundle run", "run", "project/job.yaml", timeout=1200)
    assert proc.returncode == 0, out(proc, 12000)
    assert "world size 2" in proc.stdout + proc.stderr or "2 host(s)" in proc.stderr, out(proc)
    adapter = list((shared / "output" / project.name).glob("adapter_model.safetensors"))
    assert adapter, out(proc)

    # 10. runs: the run listed, finished, with its final loss (the table, and --json for the values)
    proc = walk.ftbundle("ftbundle runs", "runs", "project/job.yaml", timeout=300)
    assert proc.returncode == 0 and "FINAL LOSS" in proc.stdout, out(proc)
    [run] = json.loads(walk.ftbundle("ftbundle runs --json", "runs", "project/job.yaml", "--json", timeout=300).stdout)
    assert run["state"] == "finished" and run["exit_code"] == 0, run
    assert isinstance(run["final_loss"], float), run  # never `-`: train_loss when no step was logged
    assert f"{run['final_loss']:.4f}" in proc.stdout, proc.stdout

    print("day zero, step times:\n" + "\n".join(f"  {label:45s} {took:7.1f} s" for label, took in walk.times))
