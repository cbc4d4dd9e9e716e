"""Every example job is valid as shipped: `ftbundle run --dry-run` plans it against the
example inventory (inventory/hosts.yml) without contacting any host."""

import subprocess
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.commands.common import load_layout
from ftbundle.plan import make_plan


def build_plan(path, inventory):
    job, layout = load_layout(path, inventory)
    return job, make_plan(layout)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.parent.name for p in (REPO / "examples").glob("*/job.yaml"))
IMAGE = yaml.safe_load((REPO / "inventory/group_vars/all.yml").read_text())["ftb_image"]


def test_the_examples_are_all_here():
    assert EXAMPLES == ["deepspeed-full", "multinode-lora", "qlora", "quickstart", "seed-script"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_dry_runs(example, capsys):
    assert main(["run", str(REPO / "examples" / example / "job.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "warning:" not in out, out  # the examples avoid the seeds' traps
    job, plan = build_plan(str(REPO / "examples" / example / "job.yaml"), None)
    if example == "quickstart":
        assert plan.all_local and plan.world_size == 2
        return
    assert [n.host.name for n in plan.nodes] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert plan.master_addr == "10.0.0.10" and plan.run_dir.startswith("/shared/ftbundle/runs/")
    for rank in range(4):
        assert f"rank {rank}  gpu-{rank}  (ssh ubuntu@10.0.0.1{rank}:22)" in out
        assert f"NODE_RANK={rank}" in out


@pytest.mark.parametrize("example", ["multinode-lora", "deepspeed-full", "qlora"])
def test_llamafactory_examples_run_in_the_pinned_image_on_every_gpu(example):
    job, plan = build_plan(str(REPO / "examples" / example / "job.yaml"), None)
    for node in plan.nodes:
        argv = list(node.argv)
        assert argv[:2] == ["docker", "run"] and IMAGE in argv
        assert argv[argv.index("--gpus") + 1] == "all"
        assert "--nproc_per_node" in argv and argv[argv.index("--nproc_per_node") + 1] == "8"
    assert plan.checkpoint_dir.startswith("/shared/ftbundle/output/")


def test_multinode_lora_prints_its_effective_batch(capsys):
    main(["run", str(REPO / "examples/multinode-lora/job.yaml"), "--dry-run"])
    assert ("effective batch size 256 = 4 per device x 2 accumulation x 8 rank(s) per node x 4 node(s)"
            in capsys.readouterr().out)


def test_deepspeed_example_stages_its_zero3_config():
    job, plan = build_plan(str(REPO / "examples/deepspeed-full/job.yaml"), None)
    staged = yaml.safe_load(plan.files["llamafactory.yaml"])
    assert staged["deepspeed"] == f"{plan.run_dir}/deepspeed.json"
    assert '"stage": 3' in plan.files["deepspeed.json"]


def test_seed_script_runs_unchanged_once_per_node():
    job, plan = build_plan(str(REPO / "examples/seed-script/job.yaml"), None)
    for rank, node in enumerate(plan.nodes):
        assert list(node.argv) == ["bash", "-c", "bash finetune_lora_ds.sh"]
        assert node.workdir == "/shared/ftbundle/qwen" and node.path_prepend == "/opt/ftbundle/venv/bin"
        assert {k: node.env[k] for k in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")} \
            == {"NNODES": "4", "NODE_RANK": str(rank), "MASTER_ADDR": "10.0.0.10", "MASTER_PORT": "6001",
                "NPROC_PER_NODE": "8"}
    assert subprocess.run(["bash", "-n", str(REPO / "examples/seed-script/finetune_lora_ds.sh")]).returncode == 0
