"""Experiment trackers (issue 47 item 4): the run id and the job name reach report_to's
trackers, TensorBoard writes under the run on shared storage, and `runs` says where each
run's tracker is."""

from __future__ import annotations

import json

import yaml

from ftbundle import trackers as T
from ftbundle.history import format_runs, run_row
from ftbundle.plan import make_plan
from tests.unit.test_check_unit import layout_of

LF = {"model_name_or_path": "org/m", "stage": "sft", "output_dir": "/shared/out"}


def test_no_tracker_no_change():
    assert T.staged({**LF, "report_to": "none"}, run_dir="/r", run_id="r1", job="j", env={}) == ({}, {}, [])
    assert T.staged(LF, run_dir="/r", run_id="r1", job="j", env={}) == ({}, {}, [])


def test_each_tracker_gets_the_run_id_and_the_job_name_and_says_where_it_is():
    keys, env, where = T.staged({**LF, "report_to": ["tensorboard", "wandb", "mlflow"]}, run_dir="/s/runs/r1",
                                run_id="r1", job="j", env={"WANDB_PROJECT": "p"})
    assert keys == {"run_name": "r1"}
    assert env == {"TENSORBOARD_LOGGING_DIR": "/s/runs/r1/tensorboard", "WANDB_TAGS": "ftbundle,j",
                   "WANDB_RUN_GROUP": "j", "MLFLOW_TAGS": json.dumps({"ftbundle.job": "j", "ftbundle.run": "r1"})}
    assert where == ["tensorboard /s/runs/r1/tensorboard", "wandb run 'r1' in project p",
                     "mlflow run 'r1' at ./mlruns (under the workdir)"]
    # the config's and the job's own choices are kept
    keys, env, where = T.staged({**LF, "report_to": "tensorboard", "run_name": "mine", "logging_dir": "/tb"},
                                run_dir="/r", run_id="r1", job="j", env={})
    assert keys == {} and where == ["tensorboard /tb"]
    assert env == {"TENSORBOARD_LOGGING_DIR": "/tb"}  # (the config's directory, where transformers 5 reads it)
    keys, env, where = T.staged({**LF, "report_to": "tensorboard"}, run_dir="/r", run_id="r1", job="j",
                                env={"TENSORBOARD_LOGGING_DIR": "/mine"}, transformers="4.57.1")
    assert keys == {"run_name": "r1", "logging_dir": "/mine"} and env == {} and where == ["tensorboard /mine"]
    _, env, _ = T.staged({**LF, "report_to": "wandb"}, run_dir="/r", run_id="r1", job="j",
                         env={"WANDB_TAGS": "x", "WANDB_RUN_GROUP": "g"})
    assert env == {}


def test_tensorboards_directory_goes_where_the_hosts_transformers_reads_it():
    """transformers 5 reads TENSORBOARD_LOGGING_DIR only (its logging_dir argument is deprecated,
    warned of and unused); transformers 4 reads logging_dir only. Unknown: the variable alone
    (staging an argument a later transformers may have dropped would stop the run)."""
    for version, argument in (("4.57.1", True), ("5.6.0", False), (None, False)):
        keys, env, _ = T.staged({**LF, "report_to": "tensorboard"}, run_dir="/r", run_id="r1", job="j", env={},
                                transformers=version)
        assert env == {"TENSORBOARD_LOGGING_DIR": "/r/tensorboard"}
        assert ("logging_dir" in keys) == argument and keys.get("logging_dir", "/r/tensorboard") == "/r/tensorboard"


def test_the_plan_stages_them_and_runs_says_where(tmp_path):
    layout = layout_of(tmp_path, 2, train={"llamafactory": {**LF, "report_to": "tensorboard,wandb".split(",")}})
    plan = make_plan(layout)
    staged = yaml.safe_load(plan.files["llamafactory.yaml"])
    assert staged["run_name"] == layout.run_id and "logging_dir" not in staged  # (no facts: transformers unknown)
    assert all(n.env["TENSORBOARD_LOGGING_DIR"] == f"{layout.run_dir}/tensorboard" for n in plan.nodes)
    assert all(n.env["WANDB_TAGS"] == f"ftbundle,{layout.job.name}" for n in plan.nodes)
    record = plan.to_dict()
    assert record["trackers"] == [f"tensorboard {layout.run_dir}/tensorboard",
                                  f"wandb run {layout.run_id!r} in project huggingface"]
    row = run_row("j-20261129-010203-abcd", {"plan.json": json.dumps(record), "summary.json": "{}"})
    lines = format_runs([row]).splitlines()
    assert lines[2:] == [f"  tracker: tensorboard {layout.run_dir}/tensorboard",
                         f"  tracker: wandb run {layout.run_id!r} in project huggingface"], lines
