"""A real Slurm in containers: Debian's slurm-wlm and munge on three containerized hosts.

``node0`` runs slurmctld, ``node1`` and ``node2`` run slurmd (partition ``debug``, the
default). Built on :class:`tests.support.cluster.Cluster`, so each Slurm cluster gets its own
random container names (``ftb-slurm-<random>-nodeI``), its own /24 in 198.18.0.0/15, the
controller's venv and ``sys.base_prefix`` bind-mounted read-only at their own paths, and
``shared_dir`` read-write at the same path everywhere. The image is
``.ci/slurmhost-image.sh`` (the test-host image plus slurm-wlm and munge)::

    with SlurmCluster(shared_dir=Path("/tmp/x")) as s:
        job_id, rc = s.sbatch(Path("/tmp/x/job.sbatch"), wait=True)

No systemd and no cgroups in the containers, hence the slurm.conf below (verified in
shared/ENVIRONMENT.md): process tracking by /proc, no task plugin, no accounting.

``SlurmCluster(gpus=2)`` is the same Slurm with GPUs it enforces (shared/ENVIRONMENT.md):
each compute node has fake GPUs ``/dev/nvidia0..N-1`` (made with mknod; no driver, so an
allowed open fails with ENXIO and a refused one with EPERM), GRES ``gpu:N`` with
``AutoDetect=off``, and task/cgroup constraining cores and devices. The containers get one
exact ``--device-cgroup-rule`` per device (a wildcard would defeat the device limit) and
their cgroup controllers remounted read-write before slurmd starts.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.support.cluster import REPO_ROOT, Cluster, ClusterError

IMAGE_SCRIPT = REPO_ROOT / ".ci" / "slurmhost-image.sh"
COMPUTE = ("node1", "node2")

SLURM_CONF = """\
# ftbundle test Slurm (tests/support/slurm.py): containers without systemd or cgroups
ClusterName=ftbtest
SlurmctldHost=node0
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurmctld.log
SlurmdLogFile=/var/log/slurmd.log
KillWait=5
NodeName=node[1-2] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""

# per container: the munge key in place, munged, then the Slurm daemon of that host
SETUP = """\
set -e
install -o munge -g munge -m 0400 /dev/stdin /etc/munge/munge.key
mkdir -p /run/munge /var/spool/slurmd /var/spool/slurmctld /etc/slurm
chown munge /run/munge
runuser -u munge -- /usr/sbin/munged
"""


def gpu_conf(slurm_conf: str, gpus: int) -> dict[str, str]:
    """slurm.conf, gres.conf and cgroup.conf of the Slurm with ``gpus`` enforced GPUs per node."""
    conf = (slurm_conf.replace("ProctrackType=proctrack/linuxproc", "ProctrackType=proctrack/cgroup")
            .replace("TaskPlugin=task/none", "TaskPlugin=task/cgroup,task/affinity")
            .replace("NodeName=node[1-2] CPUs=2", f"GresTypes=gpu\nNodeName=node[1-2] CPUs=2 Gres=gpu:{gpus}"))
    return {"slurm.conf": conf,
            "gres.conf": f"AutoDetect=off\nName=gpu File=/dev/nvidia[0-{gpus - 1}]\n",
            "cgroup.conf": ("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\nConstrainCores=yes\n"
                            "ConstrainDevices=yes\nConstrainRAMSpace=no\n")}


def gpu_docker_args(gpus: int) -> list[str]:
    args = ["--cgroupns=private", "--cap-add", "SYS_ADMIN", "--security-opt", "apparmor=unconfined",
            "--security-opt", "seccomp=unconfined"]
    for i in range(gpus):
        args += ["--device-cgroup-rule", f"c 195:{i} rwm"]
    return args


# per compute container of the GPU Slurm: the device files, and cgroups slurmd can write
GPU_SETUP = """set -e
i=0
while [ "$i" -lt "$1" ]; do [ -e /dev/nvidia$i ] || mknod -m 666 /dev/nvidia$i c 195 $i; i=$((i + 1)); done
for c in cpu cpuacct cpuset memory devices freezer; do
  umount /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c
done
"""


def ensure_slurm_image() -> str:
    """Build (or reuse, cached by recipe hash) the Slurm host image; return its reference."""
    env = dict(os.environ)
    env.setdefault("FTBUNDLE_PYTHON", os.sys.executable)
    p = subprocess.run(["bash", str(IMAGE_SCRIPT)], capture_output=True, text=True, env=env, check=False)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise ClusterError(f"{IMAGE_SCRIPT} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    return lines[-1].strip()


class SlurmCluster:
    """slurmctld on node0, slurmd on node1 and node2; ``up()`` returns once both are idle."""

    def __init__(self, *, shared_dir: Path, image: str | None = None, ready_timeout: float = 90, gpus: int = 0):
        self.shared_dir = Path(shared_dir)
        self.image = image
        self.ready_timeout = ready_timeout
        self.gpus = gpus  # GPUs per compute node, enforced (0: the plain Slurm)
        self.cluster: Cluster | None = None

    def __enter__(self) -> SlurmCluster:  # noqa: PYI034
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def controller(self) -> str:
        assert self.cluster is not None
        return self.cluster.hosts[0].container

    def container(self, name: str) -> str:
        assert self.cluster is not None
        return self.cluster.host(name).container

    def up(self) -> SlurmCluster:
        self.cluster = Cluster(3, name_prefix="ftb-slurm", shared_dir=self.shared_dir,
                               image=self.image or ensure_slurm_image(),
                               docker_args=gpu_docker_args(self.gpus) if self.gpus else ())
        self.cluster.up()
        try:
            key = os.urandom(1024)
            files = gpu_conf(SLURM_CONF, self.gpus) if self.gpus else {"slurm.conf": SLURM_CONF}
            for host in self.cluster.hosts:
                self._exec(host.container, ["sh", "-c", SETUP], input=key)
                for name, text in files.items():
                    self._exec(host.container, ["sh", "-c", f"cat > /etc/slurm/{name}"], input=text.encode())
            self._exec(self.controller, ["slurmctld"])
            for name in COMPUTE:
                if self.gpus:
                    self._exec(self.container(name), ["sh", "-c", GPU_SETUP, "sh", str(self.gpus)])
                self._exec(self.container(name), ["slurmd"])
            self._wait_idle()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        if self.cluster is not None:
            self.cluster.down()

    def _exec(self, container: str, argv: list[str], *, input: bytes | None = None,
              timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(["docker", "exec", "-i", container, *argv], input=input, capture_output=True,
                           timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise ClusterError(f"{container}: {argv} failed (rc={p.returncode}): "
                               f"{p.stderr.decode(errors='replace')[-2000:]}")
        return p

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """A command on the controller (sbatch, squeue, scontrol ...); text output."""
        p = subprocess.run(["docker", "exec", self.controller, *argv], capture_output=True, text=True,
                           timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise ClusterError(f"{argv} failed (rc={p.returncode}): {p.stderr[-2000:]}{p.stdout[-2000:]}")
        return p

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        out = ""
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in COMPUTE):
                return
            time.sleep(0.5)
        raise ClusterError(f"Slurm nodes not idle after {self.ready_timeout}s: {out!r}\n" + self.logs())

    def sbatch(self, script: Path, *args: str, wait: bool = False, timeout: float = 600) -> tuple[int, int]:
        """Submit ``script`` (a path the controller sees); (job id, exit code of sbatch)."""
        p = self.run("sbatch", "--parsable", *(["--wait"] if wait else []), *args, str(script),
                     timeout=timeout, check=False)
        first = p.stdout.strip().splitlines()[:1]
        if not first:
            raise ClusterError(f"sbatch gave no job id (rc={p.returncode}): {p.stderr}")
        return int(first[0].split(";")[0]), p.returncode

    def job_state(self, job_id: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, ...) as scontrol sees it."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def logs(self) -> str:
        assert self.cluster is not None
        parts = []
        for host, log in (("node0", "slurmctld"), ("node1", "slurmd"), ("node2", "slurmd")):
            p = self._exec(self.container(host), ["tail", "-n", "30", f"/var/log/{log}.log"], check=False)
            parts.append(f"--- {host} {log} ---\n{p.stdout.decode(errors='replace')}")
        return "\n".join(parts)
