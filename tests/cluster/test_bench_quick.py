"""The start-latency benchmark's 16-host rows in make test's reach (issue 23, item 7).

bench/launch.py runs end to end at 8 and 16 containerized hosts, one run after a warm-up:
pdsh, clush, an ssh loop and ftbundle (check off and on) each reach every host, once per
host, and every cell of its tables is filled. The timings themselves are the benchmark's
business (`make bench` writes docs/PERFORMANCE.md); a timed assertion on this shared machine
would test its load, so none is made here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.helpers import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def rows(markdown: str, header_start: str) -> dict[str, list[str]]:
    """The rows of the table whose header starts with ``header_start``, by their first cell."""
    lines = markdown.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    found = {}
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        found[cells[0]] = cells[1:]
    return found


def test_launch_bench_fills_its_8_and_16_host_rows(testhost_image, tmp_path):
    env = dict(os.environ, FTB_BENCH_OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "launch.py", "--sizes", "8,16", "--runs", "1"], cwd=REPO / "bench",
                          env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    md = (tmp_path / "launch.md").read_text()
    latency = rows(md, "| hosts | pdsh |")
    assert sorted(latency) == ["16", "8"], md
    number, times = re.compile(r"\d+\.\d\d"), re.compile(r"\d+\.\d\dx")
    for n, cells in latency.items():
        *tools, off, on, growth = cells
        assert len(tools) == 5 and all(number.fullmatch(c) for c in tools), (n, cells)  # no tool missed a host
        assert times.fullmatch(off) and times.fullmatch(on), (n, cells)
        assert times.fullmatch(growth) if n == "16" else growth == "-", (n, cells)  # 16 over 8
    cost = rows(md, "| hosts | ftbundle check off | ftbundle check on | pdsh |")
    for n, cells in cost.items():
        assert cells[-1] == f"{n} / {n}", (n, cells)  # one SSH login per host, check off and on
        assert all(re.fullmatch(r"\d+\.\d\d / \d+ / \d+ / \d+", c) for c in cells[:-1]), (n, cells)
    fixed = rows(md, "| step | s |")
    assert number.search(fixed["sum"][0]) and len(fixed) == 4, fixed


def test_node_loss_bench_fills_its_row_and_never_starts_before_the_lost_hosts_watchdog(testhost_image, tmp_path):
    """bench/node_loss.py at 3 hosts, one host cut off (silent, as one that lost power),
    `exclude`: its row is filled, its parts add up to its total (the bench refuses otherwise),
    and attempt 2's ranks began no earlier than the cut-off host's own watchdog had stopped its
    job (WATCHDOG_S + STOP_GRACE_S after its last ping, which came at most a heartbeat and a
    ping before the cut)."""
    from ftbundle.launch.node import HEARTBEAT_S, STOP_GRACE_S, WATCHDOG_S

    env = dict(os.environ, FTB_BENCH_OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "node_loss.py", "--sizes", "3", "--policies", "exclude", "--how", "cut",
                           "--no-lf"], cwd=REPO / "bench", env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = rows((tmp_path / "node_loss.md").read_text(), "| hosts | policy | loss |")["3"]
    policy, how, job, trials, *cells = row
    assert (policy, how, job, trials) == ("exclude", "cut", "DDP script", "1"), row
    detection, teardown, preflight, fence_wait, start, resume, total = map(float, cells)
    assert detection >= 4  # (5 s of silence, less the heartbeat's age at the cut)
    assert detection + teardown + preflight + fence_wait >= WATCHDOG_S + STOP_GRACE_S - 2 * HEARTBEAT_S, row
    assert resume > 0 and total > detection + teardown + fence_wait, row
    log = (tmp_path / "node_loss-3-exclude-cut.log").read_text()
    assert "attempt 2 on node[0,2]: node1 lost (no heartbeat 5 s, host unreachable)" in log, log
    assert "attempt 2 trained again" in log, log
