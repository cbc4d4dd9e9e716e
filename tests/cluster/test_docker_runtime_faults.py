"""The docker runtime's teardown guarantees (issue 20, item 7): a killed rank, Ctrl-C, a
partition and the launcher's SIGKILL while each node's job runs in a container leave no
container and no process behind, on the host or inside the engine.

Each test host runs a Docker engine of its own (nested, with the capabilities
shared/ENVIRONMENT.md lists). The image is a tiny one made on node0 from its own bash and
sleep (`docker import`) and copied to node1 with `docker save | docker load`, so both hold
the same image ID: the job pins it by that ID, as a real job would by digest. A `command:`
job needs nothing else in the image; what is under test is ftbundle's stop of `docker run`.
One cluster serves the module; each test leaves it clean (that is what it asserts).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.helpers import base_job, ftbundle, job_processes, start_ftbundle, write_job

pytestmark = pytest.mark.cluster

DOCKER_INSIDE = ["--cap-add", "SYS_ADMIN", "--cap-add", "MKNOD", "--security-opt", "seccomp=unconfined",
                 "--security-opt", "apparmor=unconfined", "--security-opt", "systempaths=unconfined",
                 "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", "-v", "/var/lib/docker"]
TINY_ROOTFS = r"""set -e
rm -rf /tmp/tiny && mkdir -p /tmp/tiny/bin /tmp/tiny/tmp
cp /usr/bin/bash /usr/bin/sleep /tmp/tiny/bin/
for lib in $(ldd /usr/bin/bash /usr/bin/sleep | grep -o '/[^ ]*\.so[^ ]*' | sort -u); do cp --parents -L "$lib" /tmp/tiny/; done
tar -C /tmp/tiny -c . | docker import - ftb-tiny:test >/dev/null
docker image inspect -f '{{.Id}}' ftb-tiny:test
"""
MARK = "sleep 173"  # the job's own process, inside its container: easy to look for


def start_engine(cluster, host) -> None:
    cluster.exec(host, "nohup dockerd >/var/log/dockerd.log 2>&1 &")
    deadline = time.monotonic() + 60
    while cluster.exec(host, "docker info >/dev/null 2>&1", check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise AssertionError(cluster.exec(host, "tail -n 30 /var/log/dockerd.log", check=False).stdout)
        time.sleep(0.5)


@pytest.fixture(scope="module")
def dcluster(testhost_image):
    """Two hosts, each with its own Docker engine and the same tiny image; (cluster, image ID)."""
    shared = Path(tempfile.mkdtemp(prefix="ftb-shared-", dir="/tmp"))
    cluster = Cluster(2, shared_dir=shared, image=testhost_image, docker_args=DOCKER_INSIDE).up()
    try:
        for host in cluster.hosts:
            start_engine(cluster, host)
            cluster.exec(host, "mkdir -p /etc/ftbundle && touch /etc/ftbundle/nccl.env")  # as site.yml leaves it
        image = cluster.exec("node0", TINY_ROOTFS).stdout.strip().splitlines()[-1]
        saved = subprocess.run(["docker", "exec", cluster.hosts[0].container, "docker", "save", "ftb-tiny:test"],
                               capture_output=True, check=True).stdout
        subprocess.run(["docker", "exec", "-i", cluster.hosts[1].container, "docker", "load"], input=saved,
                       capture_output=True, check=True)
        assert cluster.exec("node1", "docker image inspect -f '{{.Id}}' ftb-tiny:test").stdout.strip() == image
        yield cluster, image
    finally:
        cluster.down()
        shutil.rmtree(shared, ignore_errors=True)


def docker_job(cluster, image, tmp_path, name: str, **extra) -> str:
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = base_job(name, cluster.shared_dir, inventory, {"command": f"echo started; {MARK}"}, **extra)
    job["runtime"] = {"kind": "docker", "image": image}
    return str(write_job(tmp_path / "job.yaml", job))


def leftovers(cluster) -> dict[str, str]:
    """What is left of a job on each host: containers (running or not) and processes, the
    container's own included (they run in the host's process tree)."""
    left = {}
    for host in cluster.hosts:
        out = cluster.exec(host, f"docker ps -a --format '{{{{.Names}}}} {{{{.Status}}}}'; pgrep -af '{MARK}'",
                           check=False).stdout.strip()
        if out:
            left[host.name] = out
    for host, procs in job_processes(cluster).items():
        left[host] = left.get(host, "") + "\n" + "\n".join(procs)
    return left


def wait_clean(cluster, limit: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not leftovers(cluster):
            return time.monotonic() - t0
        time.sleep(0.3)
    return None


def running(proc, cluster) -> None:
    """ftbundle's rank 0 said "started" (-v) and the job's process runs in both containers."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "started" in line:
            break
        if not line:
            raise AssertionError("ftbundle ended before the job started:\n" + proc.stderr.read())
    else:
        raise AssertionError("the job never started")
    while time.monotonic() < deadline:
        # The job's own process, not the `docker run ... 'echo started; sleep 173'` client that
        # names it too and exists before its container does (the CI failure of stop 35: pkill
        # then found nothing on node1).
        if all(cluster.exec(h, f"pgrep -f '^{MARK}'", check=False).returncode == 0 for h in cluster.hosts):
            return
        time.sleep(0.3)
    raise AssertionError(f"containers not running: {leftovers(cluster)}")


def test_a_killed_rank_in_a_container_stops_every_container(dcluster, tmp_path):
    cluster, image = dcluster
    proc = start_ftbundle("run", "-v", "--no-check", docker_job(cluster, image, tmp_path, "dkill"))
    try:
        running(proc, cluster)
        cluster.exec("node1", f"pkill -KILL -f '^{MARK}'")
        proc.wait(timeout=30)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode != 0 and "node node1 (node rank 1" in err, err
    assert wait_clean(cluster, 5) is not None, leftovers(cluster)


def test_ctrl_c_stops_every_container(dcluster, tmp_path):
    cluster, image = dcluster
    proc = start_ftbundle("run", "-v", "--no-check", docker_job(cluster, image, tmp_path, "dint"))
    try:
        running(proc, cluster)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    assert wait_clean(cluster, 5) is not None, leftovers(cluster)


def test_a_partitioned_node_removes_its_own_container(dcluster, tmp_path):
    cluster, image = dcluster
    proc = start_ftbundle("run", "-v", "--no-check", docker_job(cluster, image, tmp_path, "dcut"))
    try:
        running(proc, cluster)
        cut_at = time.monotonic()
        cluster.partition("node1")
        proc.wait(timeout=60)
        # node0 is stopped by ftbundle; node1 by its own watchdog (10 s without a ping)
        took = wait_clean(cluster, 25)
        took = None if took is None else time.monotonic() - cut_at
    finally:
        proc.kill()
        cluster.heal("node1")
    err = proc.stderr.read()
    assert "node node1 (node rank 1" in err and "heartbeat" in err, err
    assert took is not None, leftovers(cluster)
    print(f"partition -> every container gone {took:.1f}s after the cut")


def test_sigkill_of_the_launcher_removes_every_container(dcluster, tmp_path):
    cluster, image = dcluster
    proc = start_ftbundle("run", "-v", "--no-check", docker_job(cluster, image, tmp_path, "dsigkill"))
    running(proc, cluster)
    killed_at = time.monotonic()
    proc.kill()
    proc.wait()
    assert wait_clean(cluster, 15) is not None, leftovers(cluster)
    print(f"launcher SIGKILLed -> every container gone {time.monotonic() - killed_at:.1f}s later")


@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detached"])
def test_a_stall_in_containers_stops_and_removes_every_container(dcluster, tmp_path, detach):
    """Nothing crashes: each node's job printed "started" and then sleeps in its container (a
    hang). The watchdog (the launcher's, or rank 0's node when detached) calls it a stall
    after stall_timeout, and every container and process goes."""
    cluster, image = dcluster
    job = docker_job(cluster, image, tmp_path, "dstall" + ("-detached" if detach else ""), stall_timeout=5)
    if detach:
        started = ftbundle("run", "--detach", "--no-check", job, timeout=120)
        assert started.returncode == 0, started.stderr
        t0 = time.monotonic()
        took = wait_clean(cluster, 5 + 90)
        status = ftbundle("status", job, timeout=60)
        assert "state: stalled" in status.stdout, status.stdout + status.stderr
    else:
        proc = start_ftbundle("run", "-v", "--no-check", job)
        try:
            running(proc, cluster)
            t0 = time.monotonic()
            proc.wait(timeout=5 + 60)
        finally:
            proc.kill()
        err = proc.stderr.read()
        print(err)
        assert proc.returncode == 124 and "stalled: no progress from any rank" in err, err
        # each node's job process is shown (a shell job: its leaf, by state and CPU), not "not found"
        assert "2 ranks with no Python stack (not a Python process: sleep)" in err, err
        assert "not found" not in err and "a collective waiting" not in err, err  # (no stack: no guess)
        # the collection's own seconds were taken for a pause of the launcher before
        assert "ftbundle itself was paused" not in err, err
        took = wait_clean(cluster, 10)
    assert took is not None, leftovers(cluster)
    print(f"stall ({'detached' if detach else 'attached'}) -> every container gone {time.monotonic() - t0:.1f}s "
          "after the job went quiet")
