"""The LlamaFactory config as ftbundle stages it: the seeds' traps turned into warnings.

Pure: takes the user's config and the job's layout, returns the config to stage and what
to tell the user before anything starts.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

# torch's own default for the process-group timeout; many LlamaFactory examples set
# ddp_timeout: 180000000 (5.7 years), which turns a dead peer into a hang that never ends.
MAX_DDP_TIMEOUT_S = 1800
HF_DEFAULT_BATCH = 8  # transformers' per_device_train_batch_size default


@dataclass(frozen=True)
class Prepared:
    config: dict[str, Any]
    warnings: tuple[str, ...]
    effective_batch: int


def prepare(config: dict[str, Any], *, workdir: str, shared_dir: str, nnodes: int,
            nproc_per_node: int, bf16_capable: bool | None = None) -> Prepared:
    config = dict(config)
    warnings = []

    output_dir = config.get("output_dir")
    if not output_dir:
        warnings.append("output_dir is not set: checkpoints go to LlamaFactory's default, not to shared storage")
    else:
        absolute = posixpath.normpath(posixpath.join(workdir, str(output_dir)))
        if not _is_under(absolute, shared_dir):
            warnings.append(
                f"output_dir {absolute} is not under the shared directory {shared_dir}: checkpoints "
                "written to local disk are lost with the node, and other nodes cannot resume from them")

    if config.get("save_total_limit") is None and config.get("save_strategy", "steps") != "no":
        warnings.append("save_total_limit is not set: every checkpoint is kept until the disk is full")

    timeout = config.get("ddp_timeout")
    if isinstance(timeout, (int, float)) and timeout > MAX_DDP_TIMEOUT_S:
        config["ddp_timeout"] = MAX_DDP_TIMEOUT_S
        warnings.append(
            f"ddp_timeout {timeout} s capped to {MAX_DDP_TIMEOUT_S} s: a dead peer would otherwise hang "
            "the others for that long (ftbundle's heartbeats catch dead nodes in seconds; if rank 0 "
            "preprocesses a large dataset while the others wait, tokenize it once beforehand with "
            "tokenized_path)")

    if config.get("fp16") and bf16_capable:
        warnings.append("fp16 on a bf16-capable GPU: bf16 needs no loss scaling and overflows less; "
                        "set bf16: true, fp16: false")

    per_device = int(config.get("per_device_train_batch_size", HF_DEFAULT_BATCH))
    accumulation = int(config.get("gradient_accumulation_steps", 1))
    effective = per_device * accumulation * nproc_per_node * nnodes
    return Prepared(config, tuple(warnings), effective)


def effective_batch_line(config: dict[str, Any], nnodes: int, nproc_per_node: int, effective: int) -> str:
    per_device = config.get("per_device_train_batch_size", HF_DEFAULT_BATCH)
    accumulation = config.get("gradient_accumulation_steps", 1)
    return (f"effective batch size {effective} = {per_device} per device x {accumulation} accumulation "
            f"x {nproc_per_node} rank(s) per node x {nnodes} node(s)")


def _is_under(path: str, parent: str) -> bool:
    parent = posixpath.normpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")
