"""Uneven fleets on containerized SSH hosts (issue 36): real sshd, real torchrun, gloo.

- 2 hosts with 2 and 1 ranks (host var ``ftb_nproc_per_node``): a script job records every
  rank's RANK, LOCAL_RANK, WORLD_SIZE, node and an all_reduce sum: world 3, ranks 0..2 once
  each, contiguous per node; a `command:` job on the same hosts gets each host's own
  NPROC_PER_NODE; a LlamaFactory LoRA trains on the 3 ranks (HF's "Total train batch size"
  counts them all);
- ``nproc_per_node: auto`` with two hosts showing different GPU counts (the nvidia-smi
  stand-in replaying a hand-made 8-GPU sample and a real recorded 1-GPU H100): planned per
  host in `--dry-run`.
"""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import (
    base_job,
    ftbundle,
    install_smi,
    only_run_dir,
    quickstart_lora,
    read_plan,
    write_job,
)

pytestmark = pytest.mark.cluster


RANKS = """\
import json, os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
rank = dist.get_rank()
with open(os.path.join(os.environ["FTB_RUN_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"RANK": int(os.environ["RANK"]), "LOCAL_RANK": int(os.environ["LOCAL_RANK"]),
               "WORLD_SIZE": int(os.environ["WORLD_SIZE"]), "world": dist.get_world_size(),
               "node": socket.gethostname(), "NODE_RANK": int(os.environ["NODE_RANK"]),
               "NPROC_PER_NODE": int(os.environ["NPROC_PER_NODE"]), "sum": t.item()}, f)
dist.destroy_process_group()
"""


def test_two_hosts_with_two_and_one_ranks(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml", per_host={"node1": {"ftb_nproc_per_node": 1}})
    (shared / "ranks.py").write_text(RANKS)
    job = write_job(tmp_path / "job.yaml", base_job("uneven", shared, inventory, {"script": "ranks.py"},
                                                    nproc_per_node=2, workdir=str(shared)))

    proc = ftbundle("run", str(job), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 node(s) with 2+1 rank(s)" in proc.stderr

    run = only_run_dir(shared)
    ranks = {r["RANK"]: r for r in (json.loads(p.read_text()) for p in run.glob("rank*.json"))}
    assert sorted(ranks) == [0, 1, 2]  # once each
    assert {r["WORLD_SIZE"] for r in ranks.values()} == {r["world"] for r in ranks.values()} == {3}
    assert {r["sum"] for r in ranks.values()} == {3.0}  # 0 + 1 + 2: every rank in one all_reduce
    # contiguous per host, in rank order: node0 has global ranks 0-1, node1 rank 2
    assert [(ranks[i]["node"], ranks[i]["NODE_RANK"], ranks[i]["LOCAL_RANK"], ranks[i]["NPROC_PER_NODE"])
            for i in range(3)] == [("node0", 0, 0, 2), ("node0", 0, 1, 2), ("node1", 1, 0, 1)]
    plan = read_plan(run)
    assert plan["world_size"] == 3 and plan["nprocs"] == [2, 1]
    assert [n["ranks"] for n in plan["nodes"]] == [[0, 1], [2, 2]]

    # a `command:` job on the same hosts: each host's own NPROC_PER_NODE
    seen = "echo $(hostname) $NODE_RANK $NPROC_PER_NODE > $FTB_RUN_DIR/seen-$NODE_RANK"
    job = write_job(tmp_path / "cmd.yaml", base_job("uneven-cmd", shared, inventory, {"command": seen},
                                                    nproc_per_node=2))
    proc = ftbundle("run", str(job), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = next(p for p in (shared / "runs").iterdir() if p.name.startswith("uneven-cmd-"))
    assert [(run / f"seen-{r}").read_text().split() for r in range(2)] == [["node0", "0", "2"], ["node1", "1", "1"]]


@pytest.mark.train
def test_llamafactory_lora_on_two_and_one_ranks(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml", per_host={"node1": {"ftb_nproc_per_node": 1}})
    train = quickstart_lora(shared, max_steps=4, save_steps=4, per_device_train_batch_size=2,
                            gradient_accumulation_steps=2)
    job = write_job(tmp_path / "job.yaml", base_job("lora-uneven", shared, inventory, {"llamafactory": train},
                                                    nproc_per_node=2))

    proc = ftbundle("run", "-v", str(job), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    # ftbundle's own line before launch, and the trainer's: 2 per device x 2 accumulation x 3 ranks
    assert "effective batch size 12 = 2 per device x 2 accumulation x 3 rank(s) (2+1 on 2 nodes)" in proc.stderr
    run = only_run_dir(shared)
    logs = {rank: (run / f"node-{rank}-node{rank}.a1.log").read_text() for rank in range(2)}
    assert "Total train batch size (w. parallel, distributed & accumulation) = 12" in proc.stdout + logs[0]
    assert "Process rank: 0, world size: 3" in logs[0] and "Process rank: 2, world size: 3" in logs[1]
    own = "".join(p.read_text() for p in (run / "ranks" / "node-0").glob("*/attempt_0/1/std*.log"))
    assert "Process rank: 1, world size: 3" in own
    assert not list((run / "ranks" / "node-1").glob("*/attempt_0/1/std*.log"))  # node1 has one rank
    assert (shared / "output/lora/adapter_model.safetensors").stat().st_size > 0
    assert json.loads((shared / "output/lora/trainer_state.json").read_text())["global_step"] == 4


def test_auto_plans_each_host_by_its_own_gpus(make_cluster, tmp_path):
    cluster = make_cluster(2)
    install_smi(cluster, "node0", "h100-x8")
    install_smi(cluster, "node1", "recorded/nvidia-h100-80gb-hbm3-x1")  # a real H100's answer
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("auto", cluster.shared_dir, inventory, {"script": "t.py"},
                                                    nproc_per_node="auto"))
    proc = ftbundle("run", str(job), "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "world size 9 = 2 node(s) with 8+1 rank(s)" in out
    assert "node rank 0  node0" in out and "8 rank(s): global 0-7" in out
    assert "node rank 1  node1" in out and "1 rank(s): global 8" in out
    assert "--nproc_per_node 8" in out and "--nproc_per_node 1" in out
    assert "NPROC_PER_NODE=8" in out and "NPROC_PER_NODE=1" in out
