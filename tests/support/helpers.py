"""Small helpers shared by the integration tests: write jobs, run ftbundle, read runs."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ASSETS = Path(__file__).resolve().parents[1] / "assets"
SMI = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi"
QUICKSTART = REPO / "examples" / "quickstart"
# What the tests make once per checkout and share (pytest-xdist workers and later runs too):
# the tiny model. Ignored by git.
TEST_CACHE = REPO / ".test-cache"


def free_port() -> int:
    """A TCP port nothing on this machine listens on now, for a localhost job's master_port:
    jobs on localhost that leave the default (29500) meet on it when tests run side by side
    (pytest-xdist workers), and the second one's check refuses it, rightly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def tiny_model() -> Path:
    """The tiny Llama made from the quickstart's data (ftbundle.tinymodel), built once per
    checkout: the build is idempotent (a stamp of its inputs) and runs under a lock, so
    parallel workers wait for one build instead of making their own."""
    out = TEST_CACHE / "tiny-llama"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / "tiny-llama.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.run([sys.executable, "-m", "ftbundle.tinymodel", "--data", str(QUICKSTART / "data/support.json"),
                            "--out", str(out)], capture_output=True, text=True, check=False,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if p.returncode != 0:
        raise RuntimeError(f"ftbundle.tinymodel failed (rc={p.returncode}):\n{p.stdout}\n{p.stderr}")
    return out


def place_tiny_model(dest: Path) -> Path:
    """A copy of the tiny model at dest (under a cluster's shared_dir, which the hosts mount
    at the same path). A copy, not a link: the hosts see only shared_dir."""
    shutil.copytree(tiny_model(), dest)
    return dest


def quickstart_lora(shared: Path, **overrides) -> dict:
    """The quickstart's LlamaFactory LoRA config for containerized hosts: its dataset and the
    tiny model copied under ``shared`` (the cluster's shared_dir), output_dir
    ``shared/output/lora``, then ``overrides`` (max_steps, save_steps, batch sizes...)."""
    quickstart = REPO / "examples" / "quickstart"
    shutil.copytree(quickstart / "data", shared / "data")
    place_tiny_model(shared / "tiny-llama")
    train = yaml.safe_load((quickstart / "train.yaml").read_text())
    train.update({"model_name_or_path": str(shared / "tiny-llama"), "dataset_dir": str(shared / "data"),
                  "output_dir": str(shared / "output/lora"), **overrides})
    return train


def plan_of(job, hosts, run_id: str = "r1", facts=None):
    """The plan of a job on hosts, as `ftbundle run` makes it: layout first, then the plan
    from the layout and the hosts' facts (None: not asked)."""
    from ftbundle.layout import make_layout
    from ftbundle.plan import make_plan

    return make_plan(make_layout(job, list(hosts), run_id), facts)


def write_job(path: Path, job: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def base_job(name: str, shared: Path, inventory: Path, train: dict, **extra) -> dict:
    """A job for the containerized cluster: this interpreter (bind-mounted) on every host."""
    job = {
        "name": name,
        "inventory": str(inventory),
        "hosts": "trainers",
        "nproc_per_node": 1,
        "master_port": 29500,
        "shared_dir": str(shared),
        "env": {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        "runtime": {"kind": "host", "python": os.path.normpath(sys.executable)},
        "train": train,
    }
    job.update(extra)
    return job


def ftbundle(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftbundle", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kw)


def sigint_ready(argv: list[str]) -> list[str]:
    """``argv`` with SIGINT at its default, as a terminal gives it. A shell starts background
    jobs with SIGINT ignored (`nohup make test &`), every child inherits that, and Python
    installs no KeyboardInterrupt handler for an ignored SIGINT: a Ctrl-C test would then
    send a signal nobody hears."""
    return [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "os.execv(sys.argv[1], sys.argv[1:])", *argv]


def start_ftbundle(*args: str) -> subprocess.Popen:
    """`ftbundle ARGS` running, its output on pipes, SIGINT as in a terminal."""
    return subprocess.Popen(sigint_ready([sys.executable, "-m", "ftbundle", *args]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def read_stdout_until(proc: subprocess.Popen, text: str, timeout: float = 60) -> list[str]:
    """Read a running ftbundle's stdout (with -v: rank 0's output) line by line until a line
    holds ``text``; the lines read, that one included. If it never shows (the output ends, or
    ``timeout`` passes), ftbundle is killed and the test fails with what it printed."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    proc.kill()
    raise AssertionError(f"{text!r} never showed on ftbundle's stdout:\n" + "".join(seen) + proc.stderr.read())


def only_run_dir(shared: Path) -> Path:
    runs = [p for p in (shared / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def read_plan(run_dir: Path) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def job_processes(cluster) -> dict[str, list[str]]:
    """Processes of any ftbundle job (FTB_JOB in their environment) on each running host."""
    left = {}
    for host in cluster.hosts:
        if not cluster.is_running(host):
            continue
        out = cluster.exec(host, "grep -lz FTB_JOB= /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | "
                                 "while read p; do echo $p $(tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null); done",
                           check=False).stdout.split("\n")
        out = [line for line in out if line.strip()]
        if out:
            left[host.name] = out
    return left


def logins_per_host(cluster) -> dict[str, int]:
    """SSH logins each host's sshd has accepted so far (sshd -D -e logs to the container)."""
    counts = {}
    for host in cluster.hosts:
        out = subprocess.run(["docker", "logs", host.container], capture_output=True, text=True).stderr
        counts[host.name] = out.count("Accepted publickey")
    return counts


def logins(cluster) -> int:
    return sum(logins_per_host(cluster).values())


def marked_pids(marker: str, *, prefix: bool = False) -> list[int]:
    """Processes on this machine, the containers' included (this /proc sees them), whose
    environment holds FTB_JOB=``marker`` (or, with ``prefix``, a value starting with it):
    what node.sh's ftb_pids finds on one host, in one scan."""
    want = f"FTB_JOB={marker}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                values = f.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(want) for v in values) if prefix else want in values:
            found.append(int(entry.name))
    return found


def install_smi(cluster, host: str, sample: str, metrics: str | None = None) -> None:
    """The nvidia-smi stand-in (tests/assets/nvidia-smi-replay) on ``host``, replaying ``sample``
    (tests/data/nvidia-smi, recorded/ included) and, for a run's GPU readings, ``metrics``
    (<metrics>.metrics.csv; default: the sample's own)."""
    box = cluster.host(host).container
    cluster.exec(host, "mkdir -p /etc/ftb-smi")
    subprocess.run(["docker", "cp", f"{SMI}/.", f"{box}:/etc/ftb-smi/"], check=True)
    subprocess.run(["docker", "cp", str(ASSETS / "nvidia-smi-replay"), f"{box}:/usr/bin/nvidia-smi"], check=True)
    cluster.exec(host, f"echo {sample} > /etc/ftb-smi/sample" + (f" && echo {metrics} > /etc/ftb-smi/metrics" if metrics else ""))
