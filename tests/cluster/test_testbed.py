"""Two checkouts' tests never take the same fixed resource (tests/support/testbed.py): a registry
that died is started again with its image (the slot table, the slots' names, subnets and ports, and
the Molecule scenarios following them: tests/unit/test_testbed_unit.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest



@pytest.mark.cluster
@pytest.mark.timeout(1500)
def test_a_registry_that_died_is_started_again_with_its_image(docker_engine):
    """ensure_registry (each provisioning test's first step): a registry whose process died
    answers again, and still serves the image by the digest the hosts pinned. On a port no
    slot uses, so the run's own registry is never touched."""
    import shutil
    import signal
    import subprocess
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.testbed import ensure_registry, registry_answers

    port = 5090
    root = Path(f"/var/lib/ftbundle-registry-{port}")
    shutil.rmtree(root, ignore_errors=True)
    try:
        # two workers finding it down at once (as the provisioning modules do on a fresh
        # machine): both start it and push to empty storage, and both get the image. Concurrent
        # pushes raced in the registry (one "manifest blob unknown") before the script held its
        # lock through the push.
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda _: ensure_registry(port, FTB_REGISTRY_PORT=str(port)), range(2)))
        pushed = both[0]
        assert pushed and "@sha256:" in pushed, both
        assert both[1] in (pushed, None), both  # None: it found the first one's registry answering
        assert ensure_registry(port, FTB_REGISTRY_PORT=str(port)) is None  # answering: nothing is run
        pids = subprocess.run(["pgrep", "-f", f"docker-registry serve {root}/config.yml"], capture_output=True,
                              text=True, check=False).stdout.split()
        assert pids
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while registry_answers(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not registry_answers(port)
        assert ensure_registry(port, FTB_REGISTRY_PORT=str(port)) == pushed  # started again; the same digest
        repo, digest = pushed.split("@")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/{repo}/manifests/{digest}", method="HEAD",
                                     headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"docker-registry serve {root}/config.yml"], check=False)
        shutil.rmtree(root, ignore_errors=True)
