"""The LlamaFactory config as ftbundle stages it: the seeds' traps turned into warnings.

Pure: takes the user's config and the job's layout, returns the config to stage and what
to tell the user before anything starts.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from .paths import is_under

# torch's own default for the process-group timeout; many LlamaFactory examples set
# ddp_timeout: 180000000 (5.7 years), which turns a dead peer into a hang that never ends.
MAX_DDP_TIMEOUT_S = 1800
HF_DEFAULT_BATCH = 8  # transformers' per_device_train_batch_size default


@dataclass(frozen=True)
class Prepared:
    config: dict[str, Any]
    warnings: tuple[str, ...]
    effective_batch: int


# Config keys that carry credentials: never staged (the staged config is a file on shared
# storage); they reach the ranks through the environment (see shims/llamafactory_entry.py).
CREDENTIAL_KEYS = ("hf_hub_token", "ms_hub_token", "om_hub_token")
CREDENTIAL_WORDS = ("token", "key", "secret", "password", "passwd")
CREDENTIAL_ENV_PREFIX = "FTB_LF_"
CREDENTIAL_FIELDS_ENV = "FTB_LF_FROM_ENV"  # the config keys to take from FTB_LF_<KEY>


def is_credential_key(key: str) -> bool:
    """A config key holding a credential: LlamaFactory's hub tokens, and any key whose last
    word is token/key/secret/password (`swanlab_api_key`), not one that merely contains it
    (`tokenized_path`, `max_new_tokens`)."""
    return key in CREDENTIAL_KEYS or str(key).lower().rsplit("_", 1)[-1] in CREDENTIAL_WORDS


def split_credentials(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the config without credentials, {key: value} of the credentials)."""
    secrets = {k: str(v) for k, v in config.items() if is_credential_key(k) and v not in (None, "")}
    return {k: v for k, v in config.items() if k not in secrets}, secrets


def credential_env(secrets: dict[str, str]) -> dict[str, str]:
    """The credentials as environment: FTB_LF_<KEY> (a secret name: masked everywhere), and
    the list of keys for the entry shim."""
    if not secrets:
        return {}
    env = {CREDENTIAL_ENV_PREFIX + k.upper(): v for k, v in secrets.items()}
    env[CREDENTIAL_FIELDS_ENV] = " ".join(secrets)
    return env


def local_datasets(config: dict[str, Any], workdir: str) -> tuple[str | None, tuple[str, ...]]:
    """(absolute dataset_dir, names of `dataset` and `eval_dataset`): what the check hashes
    on every host. (None, ()) for datasets fetched online, which have no local files."""
    names: list[str] = []
    for key in ("dataset", "eval_dataset"):
        value = config.get(key)
        if isinstance(value, str):
            value = value.split(",")
        for name in value or []:
            name = str(name).strip()
            if name and name not in names:
                names.append(name)
    dataset_dir = str(config.get("dataset_dir") or "data")
    if not names or dataset_dir == "ONLINE" or dataset_dir.startswith("REMOTE:"):
        return None, ()
    return posixpath.normpath(posixpath.join(workdir, dataset_dir)), tuple(names)


def capped(config: dict[str, Any]) -> dict[str, Any]:
    """The config as staged: a huge ddp_timeout capped (see :func:`prepare`)."""
    timeout = config.get("ddp_timeout")
    if isinstance(timeout, (int, float)) and timeout > MAX_DDP_TIMEOUT_S:
        return {**config, "ddp_timeout": MAX_DDP_TIMEOUT_S}
    return config


def prepare(config: dict[str, Any], *, workdir: str, shared_dir: str, nprocs: list[int],
            bf16_capable: bool | None = None,
            output_shared: bool | None = None) -> Prepared:
    """The config as staged and the warnings about it. ``output_shared``: what the probe
    found (every host saw every other's sentinel under output_dir); None when the hosts were
    not asked, and then only a path outside shared_dir is warned about."""
    config = dict(config)
    warnings = []

    output_dir = config.get("output_dir")
    if not output_dir:
        warnings.append("output_dir is not set: checkpoints go to LlamaFactory's default, not to shared storage")
    else:
        absolute = posixpath.normpath(posixpath.join(workdir, str(output_dir)))
        shared = output_shared if output_shared is not None else is_under(absolute, shared_dir)
        if not shared:
            warnings.append(
                f"output_dir {absolute} "
                + ("is not on storage every host shares (the hosts do not see each other's files there)"
                   if output_shared is not None else f"is not under the shared directory {shared_dir}")
                + ": checkpoints written to local disk are lost with the node, and other nodes cannot "
                "resume from them")

    if config.get("save_total_limit") is None and config.get("save_strategy", "steps") != "no":
        warnings.append("save_total_limit is not set: every checkpoint is kept until the disk is full")

    timeout = config.get("ddp_timeout")
    config = capped(config)
    if config.get("ddp_timeout") != timeout:
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
    effective = per_device * accumulation * sum(nprocs)  # nprocs: each node's ranks
    return Prepared(config, tuple(warnings), effective)


def effective_batch_line(config: dict[str, Any], nprocs: list[int], effective: int) -> str:
    """The batch one optimizer step sees; nodes with different rank counts are summed."""
    per_device = config.get("per_device_train_batch_size", HF_DEFAULT_BATCH)
    accumulation = config.get("gradient_accumulation_steps", 1)
    ranks = (f"{nprocs[0]} rank(s) per node x {len(nprocs)} node(s)" if len(set(nprocs)) == 1
             else f"{sum(nprocs)} rank(s) ({'+'.join(map(str, nprocs))} on {len(nprocs)} nodes)")
    return f"effective batch size {effective} = {per_device} per device x {accumulation} accumulation x {ranks}"

