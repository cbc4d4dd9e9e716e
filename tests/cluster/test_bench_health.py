"""The fleet-health benchmark in make test's reach (issue 37, item 6): bench/health.py at 3
containerized hosts (no straggler run: tests/cluster/test_stragglers.py is that), every cell of its
tables filled and every outcome right: the check passes with health on and off, the planted
uncorrectable ECC count is named on its host, GPU and UUID with exit 2, and the healthy
fleet's burn-in measures every host and names nobody. The timings are the benchmark's
business (`make bench`): no timed assertion on this shared machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.helpers import REPO
from tests.cluster.test_bench_quick import rows

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

SECONDS = re.compile(r"\d+\.\d\d")


def test_health_bench_fills_its_3_host_rows(testhost_image, tmp_path):
    env = dict(os.environ, FTB_BENCH_OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "health.py", "--sizes", "3", "--runs", "1", "--burn-in", "5",
                           "--no-straggler"], cwd=REPO / "bench", env=env, capture_output=True, text=True, timeout=400)
    md = (tmp_path / "health.md").read_text() if (tmp_path / "health.md").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "not right" not in md, md

    checks = rows(md, "| case | hosts |")
    assert sorted(checks) == ["1 GPU with uncorrectable ECC", "health off", "health on"], md
    for case, (hosts, runs, right, med, worst, cpu, rss) in checks.items():
        assert (hosts, runs, right) == ("3", "1", "1 of 1"), (case, checks[case])
        assert all(SECONDS.fullmatch(c) for c in (med, worst, cpu)) and rss.isdigit(), (case, checks[case])
    (cost,) = rows(md, "| hosts | health off s |").values()
    assert SECONDS.fullmatch(cost[0]) and SECONDS.fullmatch(cost[1]) and re.fullmatch(r"\d+\.\d\dx", cost[3]), cost
    assert ("node1: GPU 0 (GPU-00000001-5537-7ce0-d915-6c9a8d0e0338): 2 volatile uncorrectable ECC error(s): "
            "memory returned bad data") in md and "    failed: gpu_health" in md

    burn = rows(md, "| hosts | burn-in s |")["3"]  # the last try (a second one only when the first named a host)
    assert burn[0] == "5" and burn[3] == "3 of 3" and burn[7] == "nobody" and burn[12] == "yes", md
    # no GPU on these hosts: numpy's GEMM, no torch, a few tens of MB a host (torch's import alone is ~500 MB RSS)
    assert burn[10].startswith("numpy ") and 0 < int(burn[9]) < 150, burn
    assert float(burn[4]) > 0 and re.fullmatch(r"\d+\.\d-\d+\.\d", burn[5]), burn
    assert "A straggler during training" not in md
