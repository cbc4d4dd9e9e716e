"""Checkpoints that fit: a checkpoint's size estimated from the model and the fine-tuning mode,
against the free space where LlamaFactory's output_dir lives on each host (issue 46 item 4).

A full disk mid-run shows up as an NCCL watchdog timeout or a cut traceback, hours in; the
check can see it before anything starts. Pure: the probe reads the model's safetensors
headers (its parameters, exactly) and the free space (statvfs where the output_dir sentinel
went, remote/probe_storage.py); this module only counts.

What a HF Trainer checkpoint holds (checkpoint-N/), per trainable parameter:
- LoRA/QLoRA: the adapter (fp32: LlamaFactory upcasts trainable parameters unless pure_bf16)
  and AdamW's two states (fp32): 4 + 8 bytes per adapter parameter;
- full (and freeze, for its trainable layers) without DeepSpeed: the weights in the trainable
  parameters' dtype (fp32 unless pure_bf16: 4 bytes) and AdamW's two states (8);
- DeepSpeed ZeRO: the 16-bit weights the trainer saves (2) and the engine's states: the
  bf16 copy (2) and fp32 master weights and two Adam states (12);
plus a copy of the tokenizer files in every checkpoint. The final save (output_dir itself)
holds the weights (the adapter) without the optimizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..facts import HostFacts
from ..layout import Layout
from ..paths import is_under
from ..units import size_text
from .finding import Check, per_hosts

# LlamaFactory's lora_target "all": every linear layer of the decoder but lm_head
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MARGIN = 1.05  # the estimate's slack: trainer_state, scheduler, RNG states, file system overhead


@dataclass
class Estimate:
    checkpoint: int  # bytes of one checkpoint-N
    final: int  # bytes of the final save
    basis: str  # how it was counted, said with it


def lora_params(config: dict, rank: int, target: object) -> tuple[int, list[str]] | None:
    """The adapter's parameters: r x (in + out) for each targeted linear layer of each decoder
    layer, from config.json's shape keys; None without them."""
    try:
        h, i, layers = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    head_dim = int(config.get("head_dim") or h // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    shapes = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (heads * head_dim, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    names = [t.strip() for t in (target.split(",") if isinstance(target, str) else target or ["all"])]
    modules = list(LORA_MODULES) if "all" in names else [m for m in LORA_MODULES if m in names]
    if not modules:
        return None
    return layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules), modules


def zero_stage(deepspeed_json: str | None) -> int | None:
    try:
        stage = json.loads(deepspeed_json or "null")["zero_optimization"]["stage"]
        return int(stage)
    except (ValueError, TypeError, KeyError):
        return None


def estimate(model: dict, lf: dict, deepspeed_json: str | None) -> Estimate | None:
    """A checkpoint's bytes, from the model's facts (parameters from its safetensors headers,
    config.json) and the LlamaFactory config; None when the model's parameters are unknown."""
    params = int(model.get("params") or 0)
    if params <= 0:
        return None
    tokenizer = int(model.get("tokenizer_bytes") or 0)
    kind = str(lf.get("finetuning_type") or "lora")
    pure = bool(lf.get("pure_bf16"))
    m = f"{params / 1e9:.2f}B" if params >= 10**8 else f"{params / 1e6:.1f}M"
    if kind == "lora":
        rank = int(lf.get("lora_rank") or 8)
        counted = lora_params(model.get("config") or {}, rank, lf.get("lora_target", "all"))
        if counted is None:
            return None
        adapter, modules = counted
        per = 6 if pure else 12  # (pure bf16: a 16-bit adapter and 16-bit states)
        one = adapter * per + tokenizer
        basis = (f"LoRA r={rank} on {len(modules)} module(s) x {model['config']['num_hidden_layers']} layers: "
                 f"{adapter / 1e6:.1f}M adapter parameters x {per} B (the adapter and AdamW's 2 states)")
        final = adapter * (2 if pure else 4) + tokenizer
    else:
        stage = zero_stage(deepspeed_json) or ("?" if lf.get("deepspeed") else None)
        trainable = params
        if kind == "freeze":
            layers = int((model.get("config") or {}).get("num_hidden_layers") or 0)
            k = int(lf.get("freeze_trainable_layers") or 2)
            trainable = params * min(abs(k), layers) // layers if layers else params
        if stage:
            basis = (f"full fine-tuning, DeepSpeed ZeRO-{stage}: {m} parameters x 16 B (16-bit weights, the engine's "
                     "16-bit copy, fp32 master weights and AdamW's 2 states)")
            one = params * 2 + trainable * 14 + tokenizer
        else:
            w, states = (2, 2) if pure else (4, 8)
            basis = (f"{kind} fine-tuning: {m} parameters x {w} B ({'pure bf16' if pure else 'fp32'} weights) + "
                     f"{trainable / params:.0%} of them trainable x {states} B (AdamW's 2 states)")
            one = params * (2 if pure else 4) + trainable * (2 if pure else 8) + tokenizer
        final = params * 2 + tokenizer
    if tokenizer:
        basis += f", + the tokenizer's {size_text(tokenizer)}"
    return Estimate(int(one * MARGIN), int(final * MARGIN), basis)


def saves_kept(lf: dict) -> int | None:
    """How many checkpoints output_dir holds at most: save_total_limit, else the run's count
    when max_steps says it (max_steps // save_steps), else None (unbounded)."""
    if str(lf.get("save_strategy", "steps")) == "no":
        return 0
    limit = lf.get("save_total_limit")
    if isinstance(limit, int) and limit > 0:
        return limit
    steps, every = lf.get("max_steps"), lf.get("save_steps", 500)
    if isinstance(steps, int) and steps > 0 and isinstance(every, (int, float)) and every >= 1:
        return max(1, int(steps // every))
    return None


def check_checkpoint_space(facts: list[HostFacts], layout: Layout) -> Check | None:
    """One checkpoint fits where output_dir lives on every host (refused if not), and all the
    checkpoints the run keeps do (a warning if not). The estimate and its basis are said."""
    lf = layout.lf_config or {}
    model = next((f.model for f in facts if f.model), None)
    asked = [f for f in facts if "output_dir" in f.storage and f.storage["output_dir"].free is not None]
    if model is None or not asked or layout.checkpoint_dir is None:
        return None
    found = estimate(model, lf, layout.job.train.deepspeed_json)
    if found is None:
        return None
    path = layout.checkpoint_dir
    kept = saves_kept(lf)
    if is_under(path, layout.shared_dir):
        asked = asked[:1]  # (one file system for everyone: one host's figure)
    check = Check("checkpoint space", [], label=f"checkpoints in {path}")
    check.notes.append(f"a checkpoint is about {size_text(found.checkpoint)}: {found.basis}")
    short, tight = [], []
    for f in asked:
        free = f.storage["output_dir"].free or 0
        check.groups.append((f"{size_text(free)} free", [f.host]))
        if free < found.checkpoint:
            short.append((f.host, size_text(free), lambda hosts, free=free: (
                f"{hosts}: {size_text(free)} free where output_dir {path} lives, one checkpoint needs about "
                f"{size_text(found.checkpoint)}")))
        elif kept is not None and free < kept * found.checkpoint + found.final:
            # (kept unknown: save_total_limit unset is llamafactory.py's warning already)
            fit = int((free - found.final) // found.checkpoint) if free > found.final else 0
            want = f"the run keeps {kept} (save_total_limit or max_steps/save_steps) and the final save"
            tight.append((f.host, (fit, size_text(free)), lambda hosts, fit=fit, free=free, want=want: (
                f"on {hosts} {size_text(free)} free holds about {fit} checkpoint(s) of {size_text(found.checkpoint)} "
                f"besides the final save; {want}: the disk may fill mid-run (set save_total_limit)")))
    groups: dict[str, list[str]] = {}
    for value, hosts in check.groups:
        groups.setdefault(value, []).extend(hosts)
    check.groups = list(groups.items())
    if short:
        check.failure = "a checkpoint cannot fit where output_dir lives"
        check.details = per_hosts(short) + ["free space there, or point output_dir at a larger disk "
                                            "(on shared storage to resume from it)"]
    elif tight and kept != 0:
        check.warnings += per_hosts(tight)
    return check
