"""DeepSpeed ZeRO presets: `train.deepspeed: zero2 | zero3 | zero3_offload | path` is staged
into the run directory and referenced from the staged LlamaFactory config; ZeRO-3 across
nodes without InfiniBand is warned about; and DeepSpeed's own config parser accepts every
generated config (after transformers fills the "auto" values, as it does in training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ftbundle import deepspeed as presets
from ftbundle.cli import main
from ftbundle.errors import UserError
from ftbundle.inventory import load_hosts
from ftbundle.job import load_job
from tests.support.helpers import plan_of as make_plan

INVENTORY = "all:\n  hosts:\n" + "".join(f"    gpu-{i}: {{ansible_host: 10.9.0.{10 + i}}}\n" for i in range(4))


def plan_for(tmp_path: Path, deepspeed: str, *, hosts=2, env=None, inventory=INVENTORY):
    (tmp_path / "hosts.yml").write_text(inventory)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": "org/model", "stage": "sft", "finetuning_type": "full", "output_dir": "/shared/out", "save_total_limit": 2,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}))
    job = {"name": "ds", "inventory": "hosts.yml", "nproc_per_node": 8, "shared_dir": "/shared",
           "env": env or {}, "train": {"llamafactory": "train.yaml", "deepspeed": deepspeed}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    job = load_job(tmp_path / "job.yaml")
    return make_plan(job, load_hosts(tmp_path / "hosts.yml", "all")[:hosts], "r1")


@pytest.mark.parametrize("name,stage", [("zero2", 2), ("zero3", 3), ("zero3_offload", 3)])
def test_preset_is_staged_and_referenced(tmp_path, name, stage):
    plan = plan_for(tmp_path, name, hosts=1)
    staged = yaml.safe_load(plan.files["llamafactory.yaml"])
    assert staged["deepspeed"] == f"{plan.run_dir}/deepspeed.json"
    assert json.loads(plan.files["deepspeed.json"])["zero_optimization"]["stage"] == stage


def test_a_json_file_beside_the_job_is_staged(tmp_path):
    (tmp_path / "my_ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    plan = plan_for(tmp_path, "my_ds.json")
    assert plan.files["deepspeed.json"] == '{"zero_optimization": {"stage": 2}}'
    assert not [w for w in plan.warnings if "ZeRO" in w]


def test_zero3_across_nodes_without_infiniband_is_warned_about(tmp_path):
    warned = [w for w in plan_for(tmp_path, "zero3").warnings if "ZeRO-3" in w]
    assert len(warned) == 1 and "ZeRO-2 is the advised default" in warned[0]
    assert not [w for w in plan_for(tmp_path, "zero3", hosts=1).warnings if "ZeRO-3" in w]  # one node
    assert not [w for w in plan_for(tmp_path, "zero2").warnings if "ZeRO" in w]
    ib = plan_for(tmp_path, "zero3_offload", env={"NCCL_IB_DISABLE": "0"})
    assert not [w for w in ib.warnings if "ZeRO-3" in w]
    inv = INVENTORY.replace("all:\n", "all:\n  vars: {nccl_env_ib_disable: '0'}\n")
    assert not [w for w in plan_for(tmp_path, "zero3", inventory=inv).warnings if "ZeRO-3" in w]


def test_bad_deepspeed_values_name_the_key(tmp_path):
    with pytest.raises(UserError) as info:
        plan_for(tmp_path, "zero4")
    assert info.value.key == "train.deepspeed" and "zero2, zero3, zero3_offload" in str(info.value)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError) as info:
        plan_for(tmp_path, "bad.json")
    assert str(tmp_path / "bad.json") in str(info.value)
    (tmp_path / "job.yaml").write_text("name: s\ntrain: {script: t.py, deepspeed: zero2}\n")
    with pytest.raises(UserError) as info:
        load_job(tmp_path / "job.yaml")
    assert info.value.key == "train.deepspeed"


def test_cli_exits_2_on_a_bad_preset(tmp_path, capsys):
    plan_for(tmp_path, "zero2")
    (tmp_path / "job.yaml").write_text((tmp_path / "job.yaml").read_text().replace("zero2", "zero9"))
    assert main(["run", str(tmp_path / "job.yaml"), "--dry-run"]) == 2
    assert "train.deepspeed" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_deepspeeds_own_parser_accepts_every_preset(name):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir="/tmp/unused", per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, use_cpu=True, report_to="none")
    hf = HfTrainerDeepSpeedConfig(json.loads(presets.preset_json(name)))
    hf.trainer_config_process(args)

    class Model:  # what trainer_config_finalize reads: the hidden size for ZeRO-3's buckets
        class config:
            hidden_size = 64

    hf.trainer_config_finalize(args, Model(), 100)
    config = DeepSpeedConfig(hf.config)
    assert config.zero_optimization_stage == presets.PRESETS[name]["zero_optimization"]["stage"]
    assert config.train_micro_batch_size_per_gpu == 2 and config.gradient_accumulation_steps == 4
    assert (config.zero_config.offload_param is not None) == (name == "zero3_offload")
    with pytest.raises(Exception):  # noqa: B017 - the parser does reject a broken config (pydantic's error)
        DeepSpeedConfig({**hf.config, "zero_optimization": {"stage": "three"}})
