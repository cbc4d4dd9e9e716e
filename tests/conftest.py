"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Ansible (imported by ftbundle's inventory code) patches sys.intern; torch._dynamo, imported
# later by transformers in the same process, then refuses to register its polyfill. The
# product never mixes the two in one process (ftbundle launches training in others), but the
# test process does: importing torch's dynamo first keeps both happy.
try:
    import torch._dynamo  # noqa: F401
except ImportError:  # the training extra is not installed: those tests are skipped anyway
    pass

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.support.cluster import Cluster, ensure_image

if (
    Path(sys.modules["tests.support.cluster"].__file__).resolve()
    != REPO_ROOT / "tests" / "support" / "cluster.py"
):
    raise ImportError(
        f"'tests.support.cluster' resolves to {sys.modules['tests.support.cluster'].__file__}, not this repo's"
    )


def gpu_present() -> bool:
    """A real NVIDIA GPU: nvidia-smi lists at least one (the tests' stand-in is never on PATH
    here; it is installed only on containerized hosts and in a test's own bin directory)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and "GPU " in p.stdout


# `make test` runs the modules on several pytest-xdist workers, one module per worker at a
# time (--dist loadfile, so a module's fixtures, e.g. its cluster, are made once), handing
# out the modules in collection order (--no-loadscope-reorder). The longest go first, so
# that none starts last and runs alone: these were the longest in a measured run (seconds
# of one worker, docs/testing.md), the rest follow in file order.
LONGEST_FIRST = (
    "test_provisioning.py",
    "test_provisioning_livedin.py",
    "test_provisioning_systemd.py",
    "test_export_slurm.py",
    "test_day_zero.py",
    "test_node_loss.py",  # (five LlamaFactory runs, 3-4 hosts; 12.5 min of one worker at a load of 13-18)
    "test_detach_restart.py",
    "test_stall.py",
    "test_resume.py",
    "test_failures.py",
    "test_check.py",
    "test_launcher_core.py",
    "test_export_slurm_gpu.py",
    "test_multinode.py",
    "test_check_plan_hosts.py",
    "test_testbed.py",
    "test_ux_run.py",
    "test_check_scale.py",
    "test_export_pbs.py",
    "test_launcher_faults.py",
    "test_logs_all.py",
    "test_lint.py",
)


def _module_rank(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (a stable sort: tests keep their order inside a module);
    ``@pytest.mark.gpu`` tests run only where a GPU is present."""
    items.sort(key=_module_rank)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not gpu_present():
        skip = pytest.mark.skip(reason="no GPU here (nvidia-smi -L lists none); runs on a GPU machine")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def docker_engine() -> None:
    """A running Docker engine (started by .ci/docker-engine.sh if needed). Fails, never skips."""
    p = subprocess.run(
        ["bash", str(REPO_ROOT / ".ci" / "docker-engine.sh")],
        check=False,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        pytest.fail(
            f".ci/docker-engine.sh failed (rc={p.returncode}):\n{p.stdout}\n{p.stderr}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def testhost_image(docker_engine) -> str:
    """Reference of the test-host image (built once, cached by recipe hash)."""
    try:
        return ensure_image()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"test-host image: {e}", pytrace=False)


@pytest.fixture
def make_cluster(testhost_image):
    """Factory ``(n, shared_dir=None, **kw) -> Cluster`` (up); all torn down after the test.

    ``shared_dir`` defaults to a fresh directory under /tmp, which exists at the
    same path on the controller and on every host.
    """
    clusters: list[Cluster] = []
    tmpdirs: list[Path] = []

    def make(n: int, shared_dir: Path | None = None, **kw) -> Cluster:
        if shared_dir is None:
            shared_dir = Path(tempfile.mkdtemp(prefix="ftb-shared-", dir="/tmp"))
            tmpdirs.append(shared_dir)
        kw.setdefault("image", testhost_image)
        c = Cluster(n, shared_dir=Path(shared_dir), **kw)
        clusters.append(c)
        return c.up()

    yield make
    for c in clusters:
        c.down()
    for d in tmpdirs:
        shutil.rmtree(d, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Seconds per module (setup + call + teardown of its tests, on whichever worker ran
    it): what LONGEST_FIRST is ordered by, and where make test's time goes."""
    per_module: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            nodeid = getattr(rep, "nodeid", "")
            duration = getattr(rep, "duration", None)
            if not nodeid or duration is None or getattr(rep, "when", None) is None:
                continue
            module = nodeid.split("::", 1)[0]
            per_module[module] = per_module.get(module, 0.0) + duration
    if not per_module:
        return
    terminalreporter.write_sep("=", "seconds per module (longest first)")
    for module, secs in sorted(per_module.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{secs:8.1f}  {module}")
