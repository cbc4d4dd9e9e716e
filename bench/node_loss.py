"""Benchmark: from a host's loss to the next attempt's first step (issue 36).

N containerized hosts x 1 CPU rank (gloo), `restarts: 1`, `on_node_loss: exclude` or `spare`
(one more host in a `spares` group). The job (tests/assets/resumable.py) trains a small model
with DDP and checkpoints every 5 steps on shared storage; once a checkpoint exists, node1's
container is killed (`docker kill`: SIGKILL to everything on it, its sshd and network gone
with it). ftbundle then leaves node1 out (or puts the spare in its place), and attempt 2 resumes
from the checkpoint on the hosts left.

Split, from the kill (this script's clock) to attempt 2's first step, with ftbundle's own
marks (summary.json's "recovery", :func:`ftbundle.launch.attempts.recovery`):

- detection: the kill -> ftbundle acting on it (the node's silence found, its host probed);
- teardown: stopping every other node's processes and confirming them gone;
- preflight: choosing attempt 2's hosts (`spare`: the spare's check);
- fence wait: waiting out the lost host's own watchdog (it may be cut off, not dead, and must
  have stopped its ranks before new ones start: docs/launcher.md, "A lost host");
- start: resume point, staging, node channels, every node program running;
- resume: the ranks' start (torch import, rendezvous, checkpoint load) to the first step, as a
  node's step clock reports it (within its heartbeat, 1 s).

With ``--lf`` (default on): the same at 3 hosts with LlamaFactory LoRA on a tiny model
(tests/cluster/test_node_loss.py's job), the trainer's own resume.

    .venv/bin/python bench/node_loss.py [--sizes 3,16] [--policies exclude,spare] [--trials 1] [--no-lf]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import Cluster, ensure_image  # noqa: E402
from tests.support.helpers import job_processes, only_run_dir  # noqa: E402
from tests.cluster.test_node_loss import ddp_job, lora_job, wait_for  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from common import OUT_DIR, median, table, write_section  # noqa: E402

from ftbundle.recovery import RECOVERY_PARTS  # noqa: E402

LOSE = "node1"
KILL_AFTER_STEP = 10


def trial(n: int, policy: str, how: str, lf: bool = False) -> dict:
    """One loss (``how``: kill or cut); the recovery's parts in seconds, from the loss."""
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-loss-", dir="/tmp"))
    hosts = n + (policy == "spare")
    try:
        with Cluster(hosts, shared_dir=shared) as cluster:
            if lf:
                spares = (f"node{n}",) if policy == "spare" else ()
                job, output = lora_job(cluster, shared, f"loss-lf-{policy}", steps=30, spares=spares,
                                       on_node_loss=policy)
                ready = lambda: (output / "checkpoint-5" / "trainer_state.json").exists()  # noqa: E731
            else:
                spares = (f"node{n}",) if policy == "spare" else ()
                job, latest = ddp_job(cluster, shared, f"loss-{policy}-{n}", steps=KILL_AFTER_STEP + 40,
                                      spares=spares, on_node_loss=policy)
                ready = latest.exists
            proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", str(job)], cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            try:
                wait_for(proc, ready, 900, "checkpoint")
                killed_at = time.time()
                if how == "kill":
                    cluster.kill(LOSE)
                else:
                    cluster.partition(LOSE)
                lines = []  # (ftbundle's words, each with its second from the kill: bench/out/node_loss-*.log)
                for line in proc.stderr:
                    lines.append(f"{time.time() - killed_at:7.2f}  {line}")
                proc.wait(timeout=900)
                err = "".join(lines)
            finally:
                proc.kill()
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            (OUT_DIR / f"node_loss-{n}-{policy}-{how}{'-lf' if lf else ''}.log").write_text(err)
            if proc.returncode != 0:
                raise RuntimeError(f"ftbundle exited {proc.returncode}: {err[-3000:]}")
            run = only_run_dir(shared)
            summary = json.loads((run / "summary.json").read_text())
            attempts = summary.get("attempts") or []
            hosts_2 = attempts[1]["hosts"] if len(attempts) > 1 else []
            want = [f"node{i}" for i in range(n) if f"node{i}" != LOSE]
            if policy == "spare":
                want = [f"node{i}" if f"node{i}" != LOSE else f"node{n}" for i in range(n)]
            if summary.get("attempt") != 2 or hosts_2 != want:
                raise RuntimeError(f"attempt 2 ran on {hosts_2}, not {want}: {err[-3000:]}")
            rec = next(r for r in summary["recovery"] if r["attempt"] == 2)
            if rec.get("first_step_at") is None:
                raise RuntimeError(f"attempt 2's first step was not seen: {rec}")
            left = job_processes(cluster)
            if left:
                raise RuntimeError(f"processes left after the run: {left}")
            parts = {name: rec[name] for name in RECOVERY_PARTS}
            parts["detection"] = rec["failed_at"] - killed_at  # (from the kill, not the last heartbeat)
            parts["total"] = rec["first_step_at"] - killed_at
            if abs(sum(parts[name] for name in RECOVERY_PARTS) - parts["total"]) > 0.1:  # (consecutive marks)
                raise RuntimeError(f"the parts do not add up to the total: {parts}")
            print(f"{n} hosts {policy} {how}{' lf' if lf else ''}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()),
                  flush=True)
            return parts
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="3,16")
    parser.add_argument("--policies", default="exclude,spare")
    parser.add_argument("--how", default="kill,cut", help="kill: docker kill (its connections reset at once); "
                        "cut: its network dropped (nftables), silent as a host that lost power")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--no-lf", action="store_true", help="skip the LlamaFactory rows")
    args = parser.parse_args()
    ensure_image()
    ways, policies = args.how.split(","), args.policies.split(",")
    cases = [(int(n), policy, how, False) for n in args.sizes.split(",") for policy in policies for how in ways]
    if not args.no_lf:
        cases += [(3, policy, ways[-1], True) for policy in policies]
    rows = []
    for n, policy, how, lf in cases:
        results = [trial(n, policy, how, lf) for _ in range(args.trials)]
        cells = [f"{median([r[name] for r in results]):.1f}" for name in (*RECOVERY_PARTS, "total")]
        rows.append([n, policy, how, "LlamaFactory LoRA" if lf else "DDP script", len(results), *cells])
    md = ["## A host lost: from its loss to the next attempt's first step (issue 36)", "",
          "N containerized hosts x 1 CPU rank, gloo, `restarts: 1`. Once a checkpoint exists, node1 is lost: "
          "its container killed (`kill`: `docker kill`, its connections reset at once) or its network cut (`cut`: "
          "nftables drops all its traffic, silent as a host that lost power, and alive: its own watchdog must "
          "stop its ranks). Attempt 2 runs on the hosts left (`exclude`) or with a spare in node1's place "
          "(`spare`) and resumes from the checkpoint. Seconds from the loss, split by ftbundle's own marks "
          "(summary.json's `recovery`; `ftbundle runs` and the closing summary say the same line): "
          "detection (the kill to ftbundle acting on it), teardown (every other node stopped and confirmed), "
          "preflight (attempt 2's hosts chosen; `spare`: the spare's check), fence wait (the lost host's own "
          "watchdog waited out, so that a host only cut off has stopped its ranks before new ones start), "
          "start (resume point, staging, every node program running), resume (the ranks' start, rendezvous "
          "and checkpoint load to the first step, seen within a heartbeat).", "",
          table(["hosts", "policy", "loss", "job", "trials", *[p.replace("_", " ") + " s" for p in RECOVERY_PARTS],
                 "total s"], rows), "",
          "Detection is bounded by the launcher's lost-node rule (5 s of silence and a host that does not "
          "answer a probe); the fence wait by the nodes' watchdog (10 s after the last ping, 3 s to SIGKILL, "
          "5 s margin), counted from the lost host's last heartbeat, so the seconds already spent detecting "
          "and tearing down come off it: the launcher's part (detection to fence wait) is 17-19 s whatever the "
          "size and the policy, the fence being its floor. Resume is the job's own: on this 2-core machine all "
          "N ranks import torch at once (and other benchmarks ran beside this one), so it grows with N and "
          "with the load here, where each real host has its own cores."]
    write_section("node_loss", "\n".join(md))


if __name__ == "__main__":
    main()
