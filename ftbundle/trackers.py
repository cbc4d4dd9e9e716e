"""Experiment trackers (issue 47 item 4): the run's id and the job's name reach LlamaFactory's
``report_to`` trackers, and the run says where its tracker is. Pure.

- every tracker: ``run_name`` is the run id unless the config names one (transformers passes it
  to TensorBoard's, W&B's and MLflow's callbacks as the run's name);
- TensorBoard: its directory under the run directory on shared storage
  (``<run_dir>/tensorboard``) unless the config or the job names one, so `tensorboard --logdir
  <shared_dir>/runs` shows every run. transformers 5 reads it from ``TENSORBOARD_LOGGING_DIR``
  alone (its ``logging_dir`` argument is deprecated, warned of, and not used: the events went to
  ``<output_dir>/runs/<date>_<host>``, found by a real run in tests/train/test_quickstart.py);
  transformers 4 from ``logging_dir`` alone: the variable is set for every rank, the argument
  only where the hosts run transformers 4;
- W&B: ``WANDB_TAGS`` (ftbundle, the job's name) and ``WANDB_RUN_GROUP`` (the job's name);
  MLflow: ``MLFLOW_TAGS`` (the job and the run): unless the job's env sets them.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from .rundir import TENSORBOARD
from .units import release

TB_VARIABLE = "TENSORBOARD_LOGGING_DIR"  # where transformers 5's TensorBoard callback writes
KNOWN = ("tensorboard", "wandb", "mlflow", "comet_ml", "clearml", "swanlab", "trackio", "dvclive", "neptune")


def reported(config: dict[str, Any]) -> list[str]:
    """The trackers the config reports to (transformers' ``report_to``: a name, a list,
    "none", or "all": every one installed, which only the ranks know)."""
    value = config.get("report_to")
    if value is None:
        return []
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    names = [str(n).strip().lower() for n in names]
    return [] if names in ([], ["none"]) else names


def staged(config: dict[str, Any], *, run_dir: str, run_id: str, job: str, env: dict[str, str],
           transformers: str | None = None) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(config keys to stage, environment for the ranks, where each tracker is: said by `runs`).
    ``transformers``: the version the hosts' ranks run (None: not known)."""
    names = reported(config)
    if not names:
        return {}, {}, []
    every = "all" in names
    keys: dict[str, Any] = {}
    extra: dict[str, str] = {}
    where: list[str] = []
    name = config.get("run_name") or run_id
    if not config.get("run_name"):
        keys["run_name"] = run_id
    if every or "tensorboard" in names:
        logdir = env.get(TB_VARIABLE) or config.get("logging_dir") or posixpath.join(run_dir, TENSORBOARD)
        if TB_VARIABLE not in env:
            extra[TB_VARIABLE] = logdir
        if not config.get("logging_dir") and release(transformers)[:1] == (4,):
            keys["logging_dir"] = logdir
        where.append(f"tensorboard {logdir}")
    if every or "wandb" in names:
        if "WANDB_TAGS" not in env:
            extra["WANDB_TAGS"] = f"ftbundle,{job}"
        if "WANDB_RUN_GROUP" not in env:
            extra["WANDB_RUN_GROUP"] = job
        where.append(f"wandb run {name!r} in project {env.get('WANDB_PROJECT', 'huggingface')}")
    if every or "mlflow" in names:
        if "MLFLOW_TAGS" not in env:
            extra["MLFLOW_TAGS"] = json.dumps({"ftbundle.job": job, "ftbundle.run": run_id})
        where.append(f"mlflow run {name!r} at {env.get('MLFLOW_TRACKING_URI', './mlruns (under the workdir)')}")
    where += [f"{n} run {name!r}" for n in names if n not in ("all", "tensorboard", "wandb", "mlflow")]
    return keys, extra, where
