"""`ftbundle run` across containerized SSH hosts: real sshd, real torchrun, real LlamaFactory."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.helpers import base_job, ftbundle, job_processes, only_run_dir, quickstart_lora, read_plan, write_job

pytestmark = pytest.mark.cluster

SEED_SCRIPT = """#!/bin/bash
# A seed-style per-node script: it reads the variables people export by hand on every node.
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6001}
echo "host=$(hostname) nnodes=$NNODES node_rank=$NODE_RANK master=$MASTER_ADDR:$MASTER_PORT nproc=$NPROC_PER_NODE" \\
  "nccl_ifname=${NCCL_SOCKET_IFNAME:-unset} nccl_timeout=${NCCL_TIMEOUT:-unset}" \\
  > "$FTB_RUN_DIR/seen-$NODE_RANK.txt"
echo "node $NODE_RANK of $NNODES ready"
"""


@pytest.fixture
def cluster3(make_cluster):
    return make_cluster(3)


def test_command_mode_gives_every_host_its_rank(cluster3, tmp_path):
    shared = cluster3.shared_dir
    inventory = cluster3.write_inventory(tmp_path / "hosts.yml")
    (shared / "finetune_lora_ds.sh").write_text(SEED_SCRIPT)
    # the NCCL env file site.yml writes on every host (nccl_env role): each node's job reads its own
    for host in cluster3.hosts:
        cluster3.exec(host, "mkdir -p /etc/ftbundle && cat > /etc/ftbundle/nccl.env",
                      input=f"# written by site.yml\nNCCL_SOCKET_IFNAME==eth0\nNCCL_TIMEOUT=30{host.name[-1]}\n")
    job = write_job(tmp_path / "job.yaml", base_job(
        "seed-script", shared, inventory, {"command": "bash finetune_lora_ds.sh"}, nproc_per_node=2))

    proc = ftbundle("run", "-v", str(job), timeout=120)
    assert proc.returncode == 0, proc.stderr

    run = only_run_dir(shared)
    seen = {}
    for rank in range(3):
        fields = dict(kv.split("=", 1) for kv in (run / f"seen-{rank}.txt").read_text().split())
        seen[rank] = fields
    assert sorted(int(f["node_rank"]) for f in seen.values()) == [0, 1, 2]
    assert {f["master"] for f in seen.values()} == {f"{cluster3.hosts[0].ip}:29500"}
    assert {f["nnodes"] for f in seen.values()} == {"3"} and {f["nproc"] for f in seen.values()} == {"2"}
    assert {f["nccl_ifname"] for f in seen.values()} == {"=eth0"}
    assert [seen[r]["nccl_timeout"] for r in range(3)] == ["300", "301", "302"]  # each host's own file
    # rank order is inventory order, and each rank ran on its own host
    assert [seen[r]["host"] for r in range(3)] == ["node0", "node1", "node2"]
    for rank, host in enumerate(cluster3.hosts):
        assert (run / f"node-{rank}-{host.name}.a1.log").exists()
    # only rank 0's output reached the terminal
    assert "[node0 r0] node 0 of 3 ready" in proc.stdout
    assert "node 1 of 3" not in proc.stdout and "node 2 of 3" not in proc.stdout
    assert "node 2 of 3 ready" in (run / "node-2-node2.a1.log").read_text()


def test_failing_node_sets_exit_code_and_is_named(cluster3, tmp_path):
    shared = cluster3.shared_dir
    inventory = cluster3.write_inventory(tmp_path / "hosts.yml")
    script = ('if [ "$NODE_RANK" = 1 ]; then echo "node1: bad things"; sleep 1; exit 3; fi; '
              'echo "rank $NODE_RANK waiting"; sleep 300')
    job = write_job(tmp_path / "job.yaml", base_job("fails", shared, inventory, {"command": script}))

    started = time.monotonic()
    proc = ftbundle("run", "-v", str(job), timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr
    assert "node node1 (node rank 1" in proc.stderr and "exited with code 3" in proc.stderr
    assert "node1: bad things" in proc.stderr  # the end of the failed node's log
    assert took < 30, took
    assert job_processes(cluster3) == {}


def test_llamafactory_lora_sft_on_three_hosts(cluster3, tmp_path):
    """3 hosts x 2 ranks, gloo: world size 6, every node logs, rank 0 streams, adapter shared."""
    shared = cluster3.shared_dir
    inventory = cluster3.write_inventory(tmp_path / "hosts.yml")
    train = quickstart_lora(shared, max_steps=8, save_steps=4, per_device_train_batch_size=2)
    job = write_job(tmp_path / "job.yaml", base_job(
        "lora-3x2", shared, inventory, {"llamafactory": train}, nproc_per_node=2))

    proc = ftbundle("run", "-v", str(job), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]

    run = only_run_dir(shared)
    logs = {rank: (run / f"node-{rank}-node{rank}.a1.log").read_text() for rank in range(3)}
    assert "world size: 6" in logs[0]
    # every global rank reported in, on the node that owns it: local rank 0 in the node's log,
    # local rank 1 in a file of its own (torchrun --log-dir in the run directory)
    for node, (first, second) in {0: (0, 1), 1: (2, 3), 2: (4, 5)}.items():
        assert f"Process rank: {first}, world size: 6" in logs[node]
        assert f"Process rank: {second}," not in logs[node]
        own = "".join(p.read_text() for p in (run / "ranks" / f"node-{node}").glob("*/attempt_0/1/std*.log"))
        assert f"Process rank: {second}, world size: 6" in own
    # the terminal got rank 0's lines, and only rank 0's
    assert all(line.startswith("[node0 r0] ") for line in proc.stdout.splitlines() if line), proc.stdout[-500:]
    assert "{'loss'" in proc.stdout
    assert "Process rank: 2," not in proc.stdout and "Process rank: 4," not in proc.stdout
    assert (shared / "output/lora/adapter_model.safetensors").stat().st_size > 0
    assert read_plan(run)["world_size"] == 6
    assert not (run / "diverged.a1").exists()  # (6 ranks' healthy records: the divergence watch said nothing)
    assert json.loads((shared / "output/lora/trainer_state.json").read_text())["global_step"] == 8


def test_a_lora_that_collapses_on_two_hosts_is_stopped_on_every_node_and_not_restarted(make_cluster, tmp_path):
    """`learning_rate: 1e4` (typed for 1e-4) on two hosts: every rank judges the same all-reduced
    loss and gradient norm (shims/steptimes.py LossWatch), so every node's rank raises at the same
    logged step; rank 0's host keeps the verdict on shared storage, the launcher reads it, names
    it and does not restart (restarts: 1)."""
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    train = quickstart_lora(shared, max_steps=60, learning_rate=1.0e4)
    job = write_job(tmp_path / "job.yaml", base_job("collapse", shared, inventory, {"llamafactory": train},
                                                    nproc_per_node=1, restarts=1))
    proc = ftbundle("run", str(job), timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    run = only_run_dir(shared)
    record = json.loads((run / "diverged.a1").read_text())
    assert record["kind"] == "flat" and record["action"] == "stop" and record["step"] < 60, record
    assert f"its ranks stopped the run (divergence: stop, every rank at the same logged step): {record['said']}" in out
    assert f"not restarting: the ranks stopped the run: {record['said']}" in out
    assert not list(run.glob("node-*.a2.*")) and job_processes(cluster) == {}
    # node1's own rank said the same, at the same step (its node log: local rank 0's stderr)
    assert f"TrainingDiverged: {record['said']}" in (run / "node-1-node1.a1.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failure"]["line"] == f"its ranks stopped the run: {record['said']}", summary
