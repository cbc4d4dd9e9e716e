"""docs/PERFORMANCE.md from the sections the benchmarks wrote into bench/out/ (`make bench`)."""

from __future__ import annotations

import time

from common import OUT_DIR, REPO, machine

ORDER = ["launch", "launch_sim", "check", "health", "chatty", "teardown", "teardown_scale", "stall", "node_loss",
         "overhead", "provision", "stage", "gpu_metrics"]


def main() -> None:
    sections = [OUT_DIR / f"{name}.md" for name in ORDER if (OUT_DIR / f"{name}.md").exists()]
    head = ["# Performance", "",
            f"Written by `make bench` on {time.strftime('%Y-%m-%d', time.gmtime())}. Machine: {machine()}. "
            "The hosts are Docker containers running sshd on this same machine (tests/support/cluster.py), so the "
            "controller, the hosts' sshd and the jobs share its cores: compare the ratios within one table "
            "(measured in one run), not absolute figures across machines.", "",
            "Rerun everything with `make bench` (installs pdsh, builds the test-host image and the tiny model "
            "first), or one benchmark with `.venv/bin/python bench/<name>.py`.", ""]
    body = [s.read_text().rstrip() + "\n" for s in sections]
    (REPO / "docs" / "PERFORMANCE.md").write_text("\n".join(head) + "\n" + "\n".join(body))
    print(f"wrote docs/PERFORMANCE.md ({len(sections)} sections)")


if __name__ == "__main__":
    main()
