"""Benchmark: `ftbundle check` on many healthy hosts, then with two faults planted (issue 23, item 6).

On N containerized hosts (256 by default) whose shared storage is /srv/shared everywhere (a
link to the one shared directory), `ftbundle check job.yaml` is run as a user runs it:
- healthy, ``--runs`` times: it must pass every time (exit 0), under the load that N sshd
  and N probes put on this machine;
- then with two faults planted: one host's /srv/shared made a local directory (it sees no
  one's sentinel, no one sees its), and rank 0's firewall dropping the master port for
  another host. It must fail every time (exit 2) naming exactly those two faults, each host
  list folded into ranges (`node[0-99,101-255]`), and nothing else.
Reported per run: wall seconds, ftbundle's CPU, peak RSS, threads, fds, the report's longest
line and its failure lines. tests/cluster/test_check_scale.py does the same at 24 hosts in make test.

    .venv/bin/python bench/check.py [--hosts 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import Cluster, ensure_image  # noqa: E402
from tests.support.helpers import base_job, write_job  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from common import measure, median, table, write_section  # noqa: E402

MASTER_PORT = 29500


def expected_failures(n: int, bad_dir: int, bad_port: int) -> set[str]:
    others = f"node[0-{bad_dir - 1},{bad_dir + 1}-{n - 1}]" if bad_dir > 1 else f"node[0,2-{n - 1}]"
    return {
        f"node{bad_port} cannot connect to node0 port {MASTER_PORT} (firewall? wrong ftb_master_addr?)",
        f"node{bad_dir} does not see the sentinel of {others} in /srv/shared",
        f"{others} does not see the sentinel of node{bad_dir} in /srv/shared",
        "failed: shared_dir, master_port",
    }


def failure_lines(text: str) -> set[str]:
    """The report's failure lines (`  - what`, under each FAIL heading) and which checks failed
    (its last line: `2 of 9 checks failed in 8.2s: shared_dir, master_port`)."""
    lines = {m.group(1) for m in re.finditer(r"^\s+- (.*)$", text, re.M)}
    lines |= {f"failed: {m.group(1)}" for m in re.finditer(r"checks? failed in [\d.]+s: (.*)$", text, re.M)}
    return lines


def run_check(job: Path):
    m = measure([sys.executable, "-m", "ftbundle", "check", str(job)])
    text = m.stdout.decode() + m.stderr.decode()
    return m, text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    n = args.hosts
    bad_dir, bad_port = n // 2 - 28 if n > 60 else 1, n - 3 if n > 4 else 2
    ensure_image()
    rows, notes, last = [], [], ""
    with tempfile.TemporaryDirectory(prefix="ftb-bench-check-") as tmp:
        tmp = Path(tmp)
        shared = tmp / "shared"
        shared.mkdir()
        with Cluster(n, shared_dir=shared) as cluster:
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda h: cluster.exec(h, f"mkdir -p /srv && ln -s {shared} /srv/shared"),
                              cluster.hosts))
            inventory = cluster.write_inventory(tmp / "hosts.yml")
            job = write_job(tmp / "job.yaml", base_job("chk", shared, inventory, {"command": "true"},
                                                       shared_dir="/srv/shared"))
            cases = [("healthy", 0, None)]
            cases.append(("2 faults planted", 2, expected_failures(n, bad_dir, bad_port)))
            for case, want_code, want in cases:
                if want is not None:
                    cluster.exec(cluster.hosts[bad_dir], "rm /srv/shared && mkdir /srv/shared")
                    cluster.exec(cluster.hosts[0], "nft -f -", input=(
                        "table inet ftbtest {\n  chain input {\n    type filter hook input priority -5; "
                        f"policy accept;\n    ip saddr {cluster.hosts[bad_port].ip} tcp dport {MASTER_PORT} drop\n"
                        "  }\n}\n"))
                results = []
                for i in range(args.runs):
                    m, text = run_check(job)
                    found = failure_lines(text)
                    right = m.code == want_code and found == (want or set())
                    longest = max((len(line) for line in text.splitlines()), default=0)
                    results.append((m, right, longest))
                    last = text
                    print(f"{case} run {i}: exit {m.code} in {m.wall_s:.2f} s, as expected: {right}", flush=True)
                    if not right:
                        notes.append(f"- {case}, run {i}: exit {m.code}; failures said: "
                                     + ("; ".join(sorted(found)) or "none") + "\n\n```\n" + text[-3000:] + "\n```")
                walls = [m.wall_s for m, _, _ in results]
                rows.append([case, n, len(results), f"{sum(r for _, r, _ in results)} of {len(results)}",
                             f"{median(walls):.2f}", f"{max(walls):.2f}",
                             " / ".join(f"{median(v):.2f}" if k == 0 else f"{max(v):.0f}" for k, v in enumerate((
                                 [m.cpu_s for m, _, _ in results], [m.maxrss_mb for m, _, _ in results],
                                 [m.threads for m, _, _ in results], [m.fds for m, _, _ in results]))),
                             max(lg for _, _, lg in results)])
    said = "\n".join(f"    {line}" for line in sorted(failure_lines(last)))
    md = "\n".join([
        f"## The check at {n} hosts (issue 23, item 6)", "",
        f"`ftbundle check job.yaml` on {n} containerized hosts, run as a user runs it, {args.runs} times healthy, "
        f"then {args.runs} times with two faults planted: node{bad_dir}'s /srv/shared a local directory instead of the "
        f"shared one, and rank 0's firewall dropping port {MASTER_PORT} for node{bad_port}. `right`: the exit code "
        "(0 healthy, 2 with the faults: the check refuses) and exactly the expected failure lines, host lists folded into ranges. "
        "CPU s (median) / peak RSS MB / threads / fds (the most) of ftbundle; the longest line of its report.", "",
        table(["case", "hosts", "runs", "right", "median s", "worst s", "CPU / RSS / threads / fds",
               "longest line (chars)"], rows), "",
        "What the last faulty run said:", "", said or "    (no failure lines)",
        *(["", "Runs that were not right:", "", *notes] if notes else []),
    ])
    write_section("check", md, f"bench/check.py --hosts {n} --runs {args.runs}")


if __name__ == "__main__":
    main()
