"""Checkpoints that fit (issue 46 item 4): a checkpoint's size counted from the model's
safetensors headers and the fine-tuning mode, against the free space where output_dir lives;
refused when one cannot fit, warned when the ones the run keeps cannot."""

from __future__ import annotations

import json
import os
import shutil
import struct

from ftbundle.check import rules as R
from ftbundle.check.checkpoint_rules import estimate, lora_params, saves_kept
from ftbundle.facts import Storage, parse_facts
from ftbundle.remote import probe_files as P
from tests.unit.test_check_unit import facts, layout_of, local_spec, run_probe

# Llama 3.1 8B's config.json shape keys
LLAMA8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256}


def safetensors(path, tensors: dict[str, tuple[str, list[int]]], data: bool = True) -> None:
    """A safetensors file: its header (the tensors' dtypes and shapes), then the bytes (zeros)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = P.DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        if data:
            f.write(bytes(offset))


def test_lora_parameters_are_counted_as_peft_counts_them():
    # Llama 3 8B, r=8 on every linear layer: PEFT reports 20,971,520 trainable parameters
    assert lora_params(LLAMA8B, 8, "all") == (20_971_520, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"])
    # r=16 on q and v only: 32 x 16 x ((4096 + 4096) + (4096 + 1024)) = 6,815,744
    assert lora_params(LLAMA8B, 16, "q_proj,v_proj")[0] == 6_815_744
    assert lora_params({}, 8, "all") is None and lora_params(LLAMA8B, 8, "lm_head") is None


def test_a_checkpoints_size_follows_the_mode_and_says_its_basis():
    model = {"params": 8_030_261_248, "tokenizer_bytes": 9_085_698, "config": LLAMA8B}
    lora = estimate(model, {"lora_rank": 8}, None)
    assert lora.checkpoint == int((20_971_520 * 12 + 9_085_698) * 1.05)
    assert lora.basis == ("LoRA r=8 on 7 module(s) x 32 layers: 21.0M adapter parameters x 12 B (the adapter and "
                          "AdamW's 2 states), + the tokenizer's 9.1 MB")
    full = estimate(model, {"finetuning_type": "full"}, None)
    assert full.checkpoint == int((8_030_261_248 * 12 + 9_085_698) * 1.05)  # about 101 GB
    assert full.final == int((8_030_261_248 * 2 + 9_085_698) * 1.05)
    zero3 = estimate(model, {"finetuning_type": "full"}, json.dumps({"zero_optimization": {"stage": 3}}))
    assert zero3.checkpoint == int((8_030_261_248 * 16 + 9_085_698) * 1.05) and "ZeRO-3" in zero3.basis
    freeze = estimate(model, {"finetuning_type": "freeze", "freeze_trainable_layers": 2}, None)
    assert full.checkpoint > freeze.checkpoint > estimate(model, {"finetuning_type": "full", "pure_bf16": True},
                                                          None).checkpoint
    assert estimate({"params": 0}, {}, None) is None  # (pickled weights only: not counted)


def test_the_checkpoints_a_run_keeps():
    assert saves_kept({"save_total_limit": 3}) == 3
    assert saves_kept({"max_steps": 1000, "save_steps": 200}) == 5
    assert saves_kept({"save_strategy": "no"}) == 0
    assert saves_kept({"num_train_epochs": 3}) is None


def test_the_probe_counts_parameters_from_the_headers_and_reads_the_free_space(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    safetensors(m / "model-00001-of-00002.safetensors", {"a": ("BF16", [64, 32]), "b": ("F32", [10])})
    safetensors(m / "model-00002-of-00002.safetensors", {"c": ("BF16", [1000, 1000])}, data=False)  # (header only)
    (m / "tokenizer.json").write_text("{}" * 50)
    (m / "config.json").write_text(json.dumps({**LLAMA8B, "architectures": ["LlamaForCausalLM"]}))
    out_dir = tmp_path / "out"
    spec = local_spec(tmp_path, model=str(m), token="t1", storage=[{"name": "output_dir", "path": str(out_dir),
                                                                    "nearest": True}])
    f = parse_facts("h", 0, run_probe(spec))
    assert f.model["params"] == 64 * 32 + 10 + 1000 * 1000 and f.model["tokenizer_bytes"] == 100
    assert f.model["config"] == LLAMA8B
    free = shutil.disk_usage(tmp_path).free
    assert abs(f.storage["output_dir"].free - free) < 64 << 20, (f.storage["output_dir"].free, free)


def space_facts(free: int, **lf):
    return [facts("node0", storage={"output_dir": Storage("/local/out", written=True, where="/local", free=free)},
                  model={"params": 1_000_000_000, "tokenizer_bytes": 0, "config": LLAMA8B}),
            facts("node1", 1, storage={"output_dir": Storage("/local/out", written=True, where="/local",
                                                             free=free * 10)})]


def test_a_checkpoint_that_cannot_fit_is_refused_naming_the_host_and_the_estimate(tmp_path):
    layout = layout_of(tmp_path, 2, train={"llamafactory": {"model_name_or_path": "/models/m", "output_dir": "/local/out",
                                                            "finetuning_type": "full", "save_total_limit": 2}})
    one = int(1_000_000_000 * 12 * 1.05)
    c = R.check_checkpoint_space(space_facts(one - 1), layout)
    assert c.failure == "a checkpoint cannot fit where output_dir lives"
    assert c.details[0] == "node0: 12.6 GB free where output_dir /local/out lives, one checkpoint needs about 12.6 GB"
    assert c.notes == ["a checkpoint is about 12.6 GB: full fine-tuning: 1.00B parameters x 4 B (fp32 weights) + "
                       "100% of them trainable x 8 B (AdamW's 2 states)"]
    # one fits on node0, not the two the run keeps and the final save: a warning, node0 named
    c = R.check_checkpoint_space(space_facts(one * 2), layout)
    assert c.ok and c.warnings == ["on node0 25.2 GB free holds about 1 checkpoint(s) of 12.6 GB besides the final "
                                   "save; the run keeps 2 (save_total_limit or max_steps/save_steps) and the final "
                                   "save: the disk may fill mid-run (set save_total_limit)"]
    assert R.check_checkpoint_space(space_facts(one * 4), layout).warnings == []
    # a hub id (no model facts) or no free figure: nothing said
    assert R.check_checkpoint_space([facts("node0")], layout) is None
    # hosts whose free space differs by a few bytes (as every host's does) share a line
    fs = space_facts(one - 1)
    fs[1].storage["output_dir"] = Storage("/local/out", written=True, where="/local", free=one - 4096)
    assert R.check_checkpoint_space(fs, layout).details[0] == (
        "node[0-1]: 12.6 GB free where output_dir /local/out lives, one checkpoint needs about 12.6 GB")


def test_on_shared_storage_one_hosts_figure_counts(tmp_path):
    layout = layout_of(tmp_path, 2, train={"llamafactory": {"model_name_or_path": "/models/m",
                                                            "output_dir": "/shared/out", "save_total_limit": 1}})
    fs = space_facts(10**12)
    fs[1].storage["output_dir"] = Storage("/shared/out", written=True, where="/shared", free=1)  # (not looked at)
    c = R.check_checkpoint_space(fs, layout)
    assert c.ok and [h for _, hosts in c.groups for h in hosts] == ["node0"]
    assert os.path.basename(layout.checkpoint_dir) == "out"
