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
# of one worker, docs/testing.md), the rest follow in file order. Paths under tests/
# (tests/unit/test_layout_unit.py checks that each names a test module).
LONGEST_FIRST = (
    "cluster/test_provisioning.py",
    "cluster/test_provisioning_livedin.py",
    "cluster/test_provisioning_systemd.py",
    "cluster/test_export_slurm.py",
    "cluster/test_day_zero.py",
    "cluster/test_node_loss.py",  # (five LlamaFactory runs, 3-4 hosts; 12.5 min of one worker at a load of 13-18)
    "cluster/test_detach_restart.py",
    "cluster/test_stall.py",
    "cluster/test_resume.py",
    "cluster/test_failures.py",
    "cluster/test_check.py",
    "cluster/test_launcher_core.py",
    "cluster/test_export_slurm_gpu.py",
    "cluster/test_multinode.py",
    "cluster/test_check_plan_hosts.py",
    "cluster/test_testbed.py",
    "train/test_ux_run.py",
    "cluster/test_check_scale.py",
    "cluster/test_export_pbs.py",
    "cluster/test_launcher_faults.py",
    "cluster/test_logs_all.py",
    "lint/test_lint.py",
)

# tests/ holds its tests in folders by what they need; the markers say the same, and make unit
# and make test select by marker. A test in a folder whose marker it lacks (or with a marker
# the folder rules out) fails the collection.
FOLDER_MARKERS = {
    "unit": (set(), set()),  # (markers required, markers allowed): no Docker, no training
    "train": ({"train"}, {"train"}),  # real training on this machine, no Docker
    "cluster": ({"cluster"}, {"cluster", "train"}),  # containerized hosts (some also train)
    "gpu": ({"gpu"}, {"gpu"}),  # a real NVIDIA GPU (a lent machine)
    "lint": ({"lint"}, {"lint"}),  # ansible-lint and syntax checks
}
LAYER_MARKERS = {"cluster", "train", "lint", "gpu"}
TESTS = Path(__file__).resolve().parent


def _relative(item) -> str | None:
    """The item's module as a path under tests/ (None: outside it)."""
    try:
        return Path(item.path).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


def layer_problems(items) -> list[str]:
    """Each test whose folder and layer markers disagree, said once per test."""
    problems = []
    for item in items:
        rel = _relative(item)
        if rel is None:
            continue
        folder = rel.split("/")[0] if "/" in rel else None
        if folder not in FOLDER_MARKERS:  # (a module beside them fails tests/unit/test_layout_unit.py instead)
            continue
        required, allowed = FOLDER_MARKERS[folder]
        marks = {m.name for m in item.iter_markers()} & LAYER_MARKERS
        if not required <= marks or not marks <= allowed:
            problems.append(f"{item.nodeid}: in tests/{folder}/ with markers {sorted(marks) or 'none'}; "
                            f"tests/{folder}/ needs {sorted(required) or 'none'}"
                            + (f", allows {sorted(allowed)}" if allowed != required else ""))
    return problems


def _module_rank(item) -> int:
    rel = _relative(item)
    return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (a stable sort: tests keep their order inside a module);
    ``@pytest.mark.gpu`` tests run only where a GPU is present; every test in the folder of
    what it needs (FOLDER_MARKERS)."""
    problems = layer_problems(items)
    if problems:
        raise pytest.UsageError("tests in the wrong folder for their markers:\n  " + "\n  ".join(problems))
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
