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

from tests.cluster import Cluster, ensure_image

if (
    Path(sys.modules["tests.cluster"].__file__).resolve()
    != REPO_ROOT / "tests" / "cluster.py"
):
    raise ImportError(
        f"'tests.cluster' resolves to {sys.modules['tests.cluster'].__file__}, not this repo's"
    )


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
