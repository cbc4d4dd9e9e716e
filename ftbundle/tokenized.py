"""Tokenize once: a LlamaFactory run's tokenized dataset kept on shared storage and reused by
restarts, resumes after a lost host and later runs of an unchanged job (issue 46 item 3).

LlamaFactory tokenizes on every start (hours for a large dataset, repeated after every crash:
LlamaFactory issues 3939, 8551, 9091). Given ``tokenized_path`` it loads a saved one instead,
and saves there when there is none. ftbundle picks that path: ``<shared_dir>/cache/tokenized/KEY``
where KEY hashes everything that changes the tokenized data:

- the config without :data:`NOT_DATA` (training hyperparameters, saving, logging, the adapter:
  keys that do not touch the data; any other key, known or not, is in the key: a key missed
  costs a tokenization, never a wrong reuse), and the model's name;
- the dataset files' bytes and the tokenizer files' (read on rank 0's host by its probe,
  remote/probe_tokenized.py, which answers the key and whether that dataset is there).

Not where the job says ``tokenize_once: false``, the user set ``tokenized_path`` (theirs) or
``streaming`` (nothing to save), nor without the check (nothing hashed). LlamaFactory's
``overwrite_cache`` is about the datasets library's cache files, not this: it is in the key.
"""

from __future__ import annotations

import posixpath
from typing import Any

from . import rundir

# LlamaFactory/transformers keys that do not change the tokenized dataset
NOT_DATA = frozenset({
    "output_dir", "overwrite_output_dir", "logging_steps", "logging_dir", "logging_first_step", "save_steps",
    "save_strategy", "save_total_limit", "save_only_model", "save_safetensors", "plot_loss", "report_to",
    "run_name", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps",
    "weight_decay", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "bf16", "fp16", "pure_bf16", "tf32", "ddp_timeout", "deepspeed",
    "resume_from_checkpoint", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target",
    "additional_target", "use_dora", "use_rslora", "pissa_init", "pissa_convert", "create_new_adapter",
    "quantization_bit", "quantization_method", "double_quantization", "flash_attn", "gradient_checkpointing",
    "disable_gradient_checkpointing", "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "eval_strategy", "eval_steps", "preprocessing_num_workers", "dataloader_num_workers", "disable_tqdm",
    "freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules", "enable_liger_kernel",
    "use_unsloth", "ddp_find_unused_parameters", "load_best_model_at_end", "metric_for_best_model",
    "neftune_noise_alpha", "include_num_input_tokens_seen", "push_to_hub", "hub_model_id", "hub_token",
    "ms_hub_token", "om_hub_token", "tokenized_path", "upcast_layernorm", "upcast_lmhead_output",
    "include_tokens_per_second", "run_name",
})


def request(config: dict[str, Any] | None, shared_dir: str, model_dir: str | None) -> dict | None:
    """What rank 0's probe is asked (``spec["tokenized"]``), or None where tokenize-once does not
    apply. ``model_dir``: the model as a directory the host sees (its tokenizer files are hashed)."""
    if not config or config.get("tokenized_path") or config.get("streaming"):
        return None
    basis = {k: v for k, v in config.items() if k not in NOT_DATA}
    return {"dir": rundir.tokenized_dir(shared_dir), "basis": basis, "model_dir": model_dir}


def path_for(answer: dict | None, run_id: str) -> tuple[str, bool] | None:
    """(the tokenized_path this run's ranks get, whether it is reused): the kept dataset when the
    probe found it complete, else a fresh ``KEY.part-RUN`` that a later check promotes."""
    if not answer or "path" not in answer:
        return None
    if answer.get("ready"):
        return answer["path"], True
    return f"{answer['path']}.part-{run_id}", False


def note(path: str, reused: bool) -> str:
    if reused:
        return f"tokenized dataset: reused from {path} (same data, tokenizer and data keys)"
    return (f"tokenized dataset: made once by this run, kept at {posixpath.dirname(path)} for its restarts and "
            "later runs of the same data")
