"""DeepSpeed ZeRO presets for LlamaFactory jobs, and the advice that goes with them.

A job says ``train: {deepspeed: zero2 | zero3 | zero3_offload | path/to/ds.json}``; this
module turns the name into the JSON that is staged into the run directory, and says what
the seeds say about ZeRO across nodes. Pure: no I/O except reading a user's own file in
:func:`load` (the job schema's caller).

The presets are LlamaFactory's own (examples/deepspeed/ds_z2_config.json, ds_z3_config.json,
ds_z3_offload_config.json): ``"auto"`` values are filled in by transformers' DeepSpeed
integration from the training arguments, so batch size and precision are said once, in
the LlamaFactory config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import userfiles
from .errors import UserError

_COMMON: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
}

_ZERO2 = {
    "stage": 2,
    "allgather_partitions": True,
    "allgather_bucket_size": 500000000,
    "overlap_comm": False,
    "reduce_scatter": True,
    "reduce_bucket_size": 500000000,
    "contiguous_gradients": True,
    "round_robin_gradients": True,
}

_ZERO3 = {
    "stage": 3,
    "overlap_comm": False,
    "contiguous_gradients": True,
    "sub_group_size": 1000000000,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1000000000,
    "stage3_max_reuse_distance": 1000000000,
    "stage3_gather_16bit_weights_on_model_save": True,
}

_OFFLOAD = {
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True},
}

PRESETS: dict[str, dict[str, Any]] = {
    "zero2": {**_COMMON, "zero_optimization": _ZERO2},
    "zero3": {**_COMMON, "zero_optimization": _ZERO3},
    "zero3_offload": {**_COMMON, "zero_optimization": {**_ZERO3, **_OFFLOAD}},
}


def preset_json(name: str) -> str:
    """The preset's JSON text, as staged into the run directory."""
    return json.dumps(PRESETS[name], indent=2) + "\n"


def load(value: str, base: Path, error) -> str:
    """The JSON text for a job's ``deepspeed:`` value: a preset name, or a file relative to
    the job file. ``error(message)`` makes the UserError naming the job's key."""
    if value in PRESETS:
        return preset_json(value)
    path = (base / value).resolve()
    if not path.exists():
        raise error(f"must be one of {', '.join(PRESETS)} or a DeepSpeed JSON file; {path} does not exist")
    text = userfiles.read_text(path, "DeepSpeed config", "deepspeed")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UserError(f"DeepSpeed config is not valid JSON: {exc}", file=str(path), key="deepspeed") from None
    if not isinstance(data, dict):
        raise UserError("a DeepSpeed config must be a JSON object", file=str(path), key="deepspeed")
    return text


def zero_stage(text: str) -> int | None:
    """ZeRO stage of a DeepSpeed JSON text (None when it says none)."""
    try:
        stage = json.loads(text).get("zero_optimization", {}).get("stage")
    except (ValueError, AttributeError):
        return None
    return stage if isinstance(stage, int) else None


def advice(text: str, *, nnodes: int, infiniband: bool) -> list[str]:
    """The seeds' rule: across nodes ZeRO-2 is the default to reach for; ZeRO-3 moves the
    parameters over the network every step and needs InfiniBand-class links to pay off."""
    stage = zero_stage(text)
    if nnodes > 1 and stage == 3 and not infiniband:
        return [(f"DeepSpeed ZeRO-3 across {nnodes} nodes without InfiniBand: every step gathers the "
                "parameters over the network, which is much slower than ZeRO-2 on Ethernet. Across "
                "nodes ZeRO-2 is the advised default (deepspeed: zero2); keep ZeRO-3 for models that "
                "do not fit otherwise, or set NCCL_IB_DISABLE: 0 where the hosts have InfiniBand")]
    return []
