"""Experiment trackers (issue 47 item 4): the run id and the job name reach report_to's
trackers, TensorBoard writes under the run on shared storage, and `runs` says where each
run's tracker is."""

from __future__ import annotations

import json
import os

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
                                run_id="r1", job="j", env={"WANDB_PROJECT": "p"}, workdir="/s")
    assert keys == {"run_name": "r1"}
    assert env == {"TENSORBOARD_LOGGING_DIR": "/s/runs/r1/tensorboard", "WANDB_TAGS": "ftbundle,j",
                   "WANDB_RUN_GROUP": "j", "WANDB_DIR": "/s/runs/r1",
                   "MLFLOW_TAGS": json.dumps({"ftbundle.job": "j", "ftbundle.run": "r1"})}
    assert where == ["tensorboard /s/runs/r1/tensorboard", "wandb run 'r1' in project p",
                     "mlflow run 'r1' at sqlite:////s/mlflow.db (MLflow's default from 3.7, in rank 0's working "
                     "directory; ./mlruns there instead where that holds runs already)"]
    # the config's and the job's own choices are kept
    keys, env, where = T.staged({**LF, "report_to": "tensorboard", "run_name": "mine", "logging_dir": "/tb"},
                                run_dir="/r", run_id="r1", job="j", env={})
    assert keys == {} and where == ["tensorboard /tb"]
    assert env == {"TENSORBOARD_LOGGING_DIR": "/tb"}  # (the config's directory, where transformers 5 reads it)
    keys, env, where = T.staged({**LF, "report_to": "tensorboard"}, run_dir="/r", run_id="r1", job="j",
                                env={"TENSORBOARD_LOGGING_DIR": "/mine"}, transformers="4.57.1")
    assert keys == {"run_name": "r1", "logging_dir": "/mine"} and env == {} and where == ["tensorboard /mine"]
    _, env, _ = T.staged({**LF, "report_to": "wandb"}, run_dir="/r", run_id="r1", job="j",
                         env={"WANDB_TAGS": "x", "WANDB_RUN_GROUP": "g", "WANDB_DIR": "/w"})
    assert env == {}


def test_where_each_store_is_said_as_the_hosts_tracker_keeps_it():
    """MLflow's default store moved from ./mlruns to sqlite:///mlflow.db in 3.7 (in the logging
    rank's working directory): `runs` said ./mlruns whatever the hosts ran. A job's own tracking
    URI is said as it is; an offline W&B run is said where `wandb sync` will find it."""
    mlflow = {**LF, "report_to": "mlflow"}
    for version, store in (("2.22.1", "/w/mlruns (MLflow's default, in rank 0's working directory)"),
                           ("3.6.0", "/w/mlruns (MLflow's default, in rank 0's working directory)"),
                           ("3.7.0", "sqlite:////w/mlflow.db (MLflow's default from 3.7"),
                           ("3.17.2", "sqlite:////w/mlflow.db (MLflow's default from 3.7")):
        where = T.staged(mlflow, run_dir="/w/runs/r1", run_id="r1", job="j", env={}, workdir="/w", mlflow=version)[2]
        assert where[0].startswith(f"mlflow run 'r1' at {store}"), (version, where)
    where = T.staged(mlflow, run_dir="/r", run_id="r1", job="j", env={"MLFLOW_TRACKING_URI": "http://ml:5000"},
                     workdir="/w", mlflow="3.17.2")[2]
    assert where == ["mlflow run 'r1' at http://ml:5000"]
    _, env, where = T.staged({**LF, "report_to": "wandb"}, run_dir="/s/runs/r1", run_id="r1", job="j",
                             env={"WANDB_MODE": "offline"})
    assert env["WANDB_DIR"] == "/s/runs/r1"
    assert where == ["wandb offline run 'r1' in /s/runs/r1/wandb (`wandb sync` it)"]


def test_the_packages_the_check_looks_for():
    assert T.packages({**LF, "report_to": ["tensorboard", "mlflow", "wandb"]}) == {
        "tensorboard": ("tensorboard", "tensorboardX"), "mlflow": ("mlflow", "mlflow-skinny"), "wandb": ("wandb",)}
    assert T.packages({**LF, "report_to": "all"}) == {}  # (whatever is installed: nothing is needed)
    assert T.probed({**LF, "report_to": ["wandb"]}) == ["wandb"]
    assert len(T.probed({**LF, "report_to": "all"})) == sum(len(d) for d in T.PACKAGES.values())  # (asked: used if there)
    assert T.packages({**LF, "report_to": "none"}) == T.packages(LF) == {}


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
                                  f"wandb run {layout.run_id!r} in project llamafactory"]
    row = run_row("j-20261129-010203-abcd", {"plan.json": json.dumps(record), "summary.json": "{}"})
    lines = format_runs([row]).splitlines()
    assert lines[2:] == [f"  tracker: tensorboard {layout.run_dir}/tensorboard",
                         f"  tracker: wandb run {layout.run_id!r} in project llamafactory"], lines


BASE = {"python": "3.11.7", "torch": "2.14.1", "transformers": "5.6.0", "llamafactory": "0.9.5"}


def judged(tmp_path, report_to, fleet, env=None, **job):
    from ftbundle.check.rules import check_trackers

    layout = layout_of(tmp_path, len(fleet), train={"llamafactory": {**LF, "report_to": report_to}}, env=env or {},
                       **job)
    return check_trackers(fleet, layout)


def test_a_tracker_the_hosts_lack_is_refused_before_the_start(tmp_path):
    """report_to: wandb on hosts without wandb started, loaded the model, tokenized, then every
    rank stopped at the trainer ("WandbCallback requires wandb to be installed"). The probe asks
    for the tracker's packages; the check names the tracker, the hosts and where it looked."""
    from ftbundle.check import probe_spec
    from tests.unit.test_check_unit import facts

    layout = layout_of(tmp_path, 2, train={"llamafactory": {**LF, "report_to": ["wandb", "tensorboard"]}})
    assert probe_spec(layout, 1, token=None, expect=[0, 1], port_peers=None)["packages"] == [
        "torch", "transformers", "llamafactory", "wandb", "tensorboard", "tensorboardX"]
    fleet = [facts("node0", versions={**BASE, "wandb": "absent", "tensorboard": "absent", "tensorboardX": "2.6"}),
             facts("node1", 1, versions={**BASE, "wandb": "0.31.0", "tensorboard": "absent", "tensorboardX": "absent"}),
             facts("node2", 2, versions={**BASE, "wandb": "absent", "tensorboard": "2.20", "tensorboardX": "absent"})]
    c = judged(tmp_path, ["wandb", "tensorboard"], fleet, runtime={"kind": "host", "python": "/opt/venv/bin/python"})
    assert c.failure == "tracker not installed"
    assert c.details == [
        "wandb (report_to in train.llamafactory (inline)) is not installed in /opt/venv/bin/python on node[0,2]",
        "tensorboard (report_to in train.llamafactory (inline)) is not installed in /opt/venv/bin/python on node1: "
        "none of tensorboard, tensorboardX",
        "(the trainer imports each tracker once the model is loaded: install it in /opt/venv/bin/python, or take it "
        "out of report_to)"]
    alike = {**BASE, "wandb": "0.31.0", "tensorboard": "absent", "tensorboardX": "2.6"}
    login = {"netrc": "/root/.netrc", "machines": ["api.wandb.ai"], "settings_key": False}
    assert judged(tmp_path, ["wandb", "tensorboard"], [facts("node0", versions=alike, wandb_login=login),
                                                       facts("node1", 1, versions=alike)]).ok  # (tensorboardX will do)
    assert judged(tmp_path, "none", [facts("node0")]) is None


def test_mlflow_skinny_asked_to_write_a_database_is_refused(tmp_path):
    """mlflow-skinny (no SQLAlchemy) from 3.7 defaults to sqlite:///mlflow.db and fails at the
    first log (MLflow 3.17.2: 'Model registry functionality is unavailable; got unsupported URI
    sqlite:///...'); a server's URI, or the full package beside it, is fine."""
    from tests.unit.test_check_unit import facts

    skinny = {**BASE, "mlflow": "absent", "mlflow-skinny": "3.17.2"}
    fleet = [facts("node0", versions=skinny), facts("node1", 1, versions=skinny)]
    c = judged(tmp_path, "mlflow", fleet)
    assert c.failure == "tracker cannot log"
    assert c.details == ["mlflow-skinny 3.17.2 on node0 cannot write sqlite:///mlflow.db (MLflow's default "
                         "store): a database store needs the full mlflow package (SQLAlchemy)",
                         "(set MLFLOW_TRACKING_URI in the job's env to your MLflow server, or install mlflow beside it)"]
    c = judged(tmp_path, "mlflow", fleet, env={"MLFLOW_TRACKING_URI": "sqlite:////s/m.db"})
    assert c.details[0].startswith("mlflow-skinny 3.17.2 on node0 cannot write sqlite:////s/m.db:")
    # rank 0 alone logs: its URI may come from its env file or login environment; other hosts' MLflow is not asked
    served = [facts("node0", versions=skinny, env={"MLFLOW_TRACKING_URI": "http://mlflow:5000"}), fleet[1]]
    assert judged(tmp_path, "mlflow", served).ok
    full = {**BASE, "mlflow": "3.17.2", "mlflow-skinny": "3.17.2"}
    assert judged(tmp_path, "mlflow", [facts("node0", versions=full), fleet[1]]).ok
    for uri in ("http://mlflow:5000", "databricks"):
        assert judged(tmp_path, "mlflow", fleet, env={"MLFLOW_TRACKING_URI": uri}).ok
    # report_to: all uses MLflow where it is installed: the same store is asked of it
    assert judged(tmp_path, "all", fleet).failure == "tracker cannot log"
    assert judged(tmp_path, "tensorboard", [facts("node0", versions={**skinny, "tensorboard": "2.2"})]).ok
    old = {**BASE, "mlflow": "absent", "mlflow-skinny": "3.6.0"}  # (./mlruns by default then)
    for versions in (full, old):
        assert judged(tmp_path, "mlflow", [facts("node0", versions=versions)]).ok


def test_mlflow_asked_for_a_file_store_without_the_opt_in_is_refused(tmp_path):
    """MLflow 3.13 made its file store raise unless MLFLOW_ALLOW_FILE_STORE is true (MLflow
    3.17.2 here: 'The filesystem tracking backend (e.g., './mlruns') is in maintenance mode ...',
    at the first log, once the model is loaded): a cluster without an MLflow server writes
    file:///shared/mlruns. The opt-in from the job's env or rank 0's own passes; older MLflow,
    servers and databases are not judged by this rule."""
    from tests.unit.test_check_unit import facts

    full = {**BASE, "mlflow": "3.17.2", "mlflow-skinny": "absent"}
    fleet = [facts("node0", versions=full), facts("node1", 1, versions=full)]
    for uri in ("file:///shared/mlruns", "/shared/mlruns", "./mlruns"):
        c = judged(tmp_path, "mlflow", fleet, env={"MLFLOW_TRACKING_URI": uri})
        assert c.failure == "tracker cannot log"
        assert c.details == [
            f"mlflow 3.17.2 on node0 refuses the file store {uri} unless MLFLOW_ALLOW_FILE_STORE is true (from "
            "MLflow 3.13: 'The filesystem tracking backend ... is in maintenance mode'): the first log would stop "
            "the run once the model is loaded",
            "(set MLFLOW_ALLOW_FILE_STORE: \"true\" in the job's env to keep the file store, or MLFLOW_TRACKING_URI "
            "to your MLflow server)"]
    store = {"MLFLOW_TRACKING_URI": "file:///shared/mlruns"}
    assert judged(tmp_path, "mlflow", fleet, env={**store, "MLFLOW_ALLOW_FILE_STORE": "true"}).ok
    assert judged(tmp_path, "mlflow", fleet, env={**store, "MLFLOW_ALLOW_FILE_STORE": "1"}).ok
    assert judged(tmp_path, "mlflow", fleet, env={**store, "MLFLOW_ALLOW_FILE_STORE": "false"}).failure
    own = [facts("node0", versions=full, env={**store, "MLFLOW_ALLOW_FILE_STORE": "True"}), fleet[1]]
    assert judged(tmp_path, "mlflow", own).ok  # (rank 0's env file or login environment)
    skinny = {**BASE, "mlflow": "absent", "mlflow-skinny": "3.13.0"}
    assert judged(tmp_path, "mlflow", [facts("node0", versions=skinny)], env=store).failure
    assert judged(tmp_path, "mlflow", [facts("node0", versions={**full, "mlflow": "3.12.1"})], env=store).ok
    for uri in ("http://mlflow:5000", "databricks", "sqlite:////shared/m.db"):
        assert judged(tmp_path, "mlflow", fleet, env={"MLFLOW_TRACKING_URI": uri}).ok


def test_wandb_online_without_a_key_where_rank_0_logs_is_refused(tmp_path):
    """wandb.init on rank 0 with no key stops the run once the model is loaded (wandb 0.31: 'No
    API key configured. Use `wandb login` to log in.', no terminal to ask). Any place wandb reads
    a key from, or a mode that needs none, passes; only rank 0's host is asked."""
    from ftbundle.check import probe_spec
    from tests.unit.test_check_unit import facts

    layout = layout_of(tmp_path, 2, train={"llamafactory": {**LF, "report_to": "wandb"}})
    rank0 = probe_spec(layout, 0, token=None, expect=[0, 1], port_peers=None)
    assert rank0["wandb_login"] is True and rank0["trackers"] is True
    assert not {"wandb_login", "trackers"} & set(probe_spec(layout, 1, token=None, expect=[0, 1], port_peers=None))
    docker = layout_of(tmp_path, 2, train={"llamafactory": {**LF, "report_to": "wandb"}},
                       runtime={"kind": "docker", "image": "reg/t@sha256:" + "a" * 64})
    spec = probe_spec(docker, 0, token=None, expect=[0, 1], port_peers=None)
    assert "wandb_login" not in spec and spec["trackers"] is True  # (its home is not ours; its env file is)

    versions = {**BASE, "wandb": "0.31.0"}
    bare = {"netrc": "/home/u/.netrc", "machines": None, "settings_key": False, "netrc_error": "No such file"}

    def fleet(login=bare, env=None):
        return [facts("node0", versions=versions, wandb_login=login, env=env or {}), facts("node1", 1, versions=versions)]

    c = judged(tmp_path, "wandb", fleet())
    assert c.failure == "tracker cannot log"
    assert c.details[0] == (
        "wandb (report_to) has no API key on node0, where rank 0 logs: no WANDB_API_KEY in the job's env, its env "
        "file or the login environment, no /home/u/.netrc, and WANDB_MODE is not offline: wandb.init would stop the "
        "run once the model is loaded ('No API key configured')")
    other = {**bare, "machines": ["github.com"], "netrc_error": None}
    assert ("/home/u/.netrc has no entry for api.forge.coreweave.com or api.wandb.ai"
            in judged(tmp_path, "wandb", fleet(other)).details[0])
    assert judged(tmp_path, "all", fleet()).failure == "tracker cannot log"  # (wandb installed: "all" uses it)
    # each place a key or a keyless mode can come from
    assert judged(tmp_path, "wandb", fleet(), env={"WANDB_API_KEY": "k"}).ok
    assert judged(tmp_path, "wandb", fleet(), env={"WANDB_MODE": "offline"}).ok
    assert judged(tmp_path, "wandb", fleet(env={"WANDB_API_KEY": "(set)"})).ok  # (the login's or the env file's)
    assert judged(tmp_path, "wandb", fleet(env={"WANDB_MODE": "disabled"})).ok
    assert judged(tmp_path, "wandb", fleet({**other, "machines": ["api.wandb.ai"]})).ok
    # wandb 0.31's `wandb login` writes its default server's entry (tests/train/test_trackers.py runs it)
    assert judged(tmp_path, "wandb", fleet({**other, "machines": ["api.forge.coreweave.com"]})).ok
    assert judged(tmp_path, "wandb", fleet({**other, "machines": ["default"]})).ok
    assert judged(tmp_path, "wandb", fleet({**bare, "settings_key": True})).ok
    assert judged(tmp_path, "wandb", fleet({**other, "machines": ["wandb.corp"]}),
                  env={"WANDB_BASE_URL": "https://wandb.corp"}).ok
    assert judged(tmp_path, "wandb", fleet(), env={"WANDB_BASE_URL": "https://wandb.corp"}).failure  # (no netrc at all)
    # `wandb login --host URL` (wandb 0.31) writes URL's entry to the netrc and URL as base_url to its settings file
    hosted = {**other, "machines": ["wandb.corp"], "settings_base_url": "https://wandb.corp"}
    assert judged(tmp_path, "wandb", fleet(hosted)).ok
    assert "has no entry for wandb.corp" in judged(tmp_path, "wandb", fleet({**hosted, "machines": []})).details[0]
    # not asked (the docker runtime, an older probe): not judged
    assert judged(tmp_path, "wandb", [facts("node0", versions=versions)]).ok


def test_no_report_to_is_every_installed_tracker_on_transformers_4(tmp_path):
    """transformers 4 (LlamaFactory 0.9.5 takes 4.55 up) reports to every installed tracker when
    report_to is not set; 5 to none. A config without report_to on transformers 4 hosts with wandb
    installed and no key is the same failure as report_to: wandb, and is judged the same; on
    transformers 5 nothing is. The hosts need not agree on trackers (only rank 0 logs): tracker
    packages are shown on the trackers line, not compared on the versions line."""
    from ftbundle.check import probe_spec
    from ftbundle.check import rules as R
    from ftbundle.check.rules import check_trackers
    from tests.unit.test_check_unit import facts

    layout = layout_of(tmp_path, 2, train={"llamafactory": LF})
    spec = probe_spec(layout, 0, token=None, expect=[0, 1], port_peers=None)
    assert spec["wandb_login"] is True and spec["packages"][3:] == T.probed({})
    assert {"wandb", "mlflow-skinny", "tensorboardX"} <= set(T.probed({}))
    bare = {"netrc": "/root/.netrc", "machines": None, "settings_key": False}
    for transformers, refused in (("4.57.1", True), ("5.6.0", False)):
        versions = {**BASE, "transformers": transformers, "wandb": "0.31.0"}
        fleet = [facts("node0", versions=versions, wandb_login=bare), facts("node1", 1, versions=versions)]
        c = check_trackers(fleet, layout)
        assert (c is not None and c.failure == "tracker cannot log") == refused, (transformers, c)
        assert T.reported(LF, transformers) == (["all"] if refused else [])
    assert T.reported(LF) == []  # (the hosts' transformers not known: nothing assumed)
    one = [facts("node0", versions={**BASE, "wandb": "0.31.0", "mlflow": "absent"}),
           facts("node1", 1, versions={**BASE, "wandb": "absent", "mlflow": "absent"})]
    assert R.check_runtime(one, docker=False, mode="llamafactory").ok
    assert R.check_runtime(one, docker=False, mode="llamafactory").groups == [
        ("python=3.11.7 torch=2.14.1 transformers=5.6.0 llamafactory=0.9.5", ["node0", "node1"])]
    c = check_trackers(one, layout_of(tmp_path, 2, train={"llamafactory": {**LF, "report_to": "tensorboard"}}))
    assert c.groups == [("none installed", ["node0", "node1"])] and c.label == "trackers (tensorboard)"


def test_the_probe_says_no_key_and_no_password():
    """The tracker variables leave the host masked: W&B's key as "(set)", a tracking URI without
    its user and password; the rest as they are."""
    from ftbundle.remote.probe import masked

    assert masked("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567") == "(set)"
    assert masked("MLFLOW_TRACKING_URI", "https://bob:hunter2@mlflow.corp:5000/x") == "https://mlflow.corp:5000/x"
    assert masked("MLFLOW_TRACKING_URI", "postgresql+psycopg2://u:p@db/mlflow") == "postgresql+psycopg2://db/mlflow"
    for value in ("sqlite:////shared/mlflow.db", "http://mlflow:5000", "databricks", "file:///s/mlruns"):
        assert masked("MLFLOW_TRACKING_URI", value) == value
    assert masked("WANDB_MODE", "offline") == "offline"


def test_what_the_real_wandb_login_writes_passes_the_check(tmp_path, monkeypatch):
    """The probe reads what wandb 0.31's own `wandb login` wrote (its default server's netrc
    entry, api.forge.coreweave.com; with --host, that server's entry and base_url in W&B's
    settings file), and the check passes both: they are where wandb.init finds its key."""
    import subprocess
    import sys
    from pathlib import Path

    from ftbundle.remote import probe_trackers as probe
    from tests.unit.test_check_unit import facts

    versions = {**BASE, "wandb": "0.31.0"}
    for extra, machine, base_url in (([], "api.forge.coreweave.com", None),
                                     (["--host", "https://wandb.corp.example"], "wandb.corp.example",
                                      "https://wandb.corp.example")):
        home = tmp_path / (machine + "-home")
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
        login = subprocess.run([str(Path(sys.executable).parent / "wandb"), "login", *extra, "--no-verify", "k" * 40],
                               capture_output=True, text=True, timeout=120, env={**env, "HOME": str(home)})
        assert login.returncode == 0, login.stdout + login.stderr
        monkeypatch.setenv("HOME", str(home))
        seen = probe.wandb_login({})
        assert seen["machines"] == [machine] and seen.get("settings_base_url") == base_url and not seen["settings_key"]
        assert judged(tmp_path, "wandb", [facts("node0", versions=versions, wandb_login=seen)]).ok
        assert "k" * 40 not in json.dumps(seen)  # (the key never leaves the host)


def test_the_runs_rank_0_kept_replace_what_the_plan_said():
    """`runs` says the MLflow and W&B runs rank 0 logged to (trackers.json) in place of the plan's
    prediction: ids, experiment, store, URL or offline directories, the attempts that logged."""
    said = ["tensorboard /s/runs/r1/tensorboard", "wandb run 'r1' in project p", "mlflow run 'r1' at http://m:5000"]
    assert T.placed(said, None) == T.placed(said, {}) == T.placed(said, ["junk"]) == said
    kept = {"attempt": 1, "began": 1, "mlflow": {"run_id": "ab12", "name": "r1", "experiment_id": "3",
                                                  "tracking_uri": "http://m:5000"},
            "wandb": {"id": "x9", "name": "r1", "project": "p", "entity": "team", "offline": False,
                      "url": "https://wandb.ai/team/p/runs/x9", "dir": None}, "wandb_dirs": []}
    assert T.placed(said, kept) == ["tensorboard /s/runs/r1/tensorboard",
                                    "wandb run 'r1' (id x9) https://wandb.ai/team/p/runs/x9",
                                    "mlflow run 'r1' (id ab12, experiment 3) at http://m:5000"]
    offline = {**kept, "attempt": 3, "wandb": {**kept["wandb"], "offline": True, "url": None},
               "wandb_dirs": ["/s/runs/r1/wandb/offline-run-1-x9", "/s/runs/r1/wandb/offline-run-2-x9"]}
    assert T.placed(said[1:2], offline) == [
        "wandb offline run 'r1' (id x9, attempts 1-3): `wandb sync /s/runs/r1/wandb/offline-run-1-x9 "
        "/s/runs/r1/wandb/offline-run-2-x9`"]
    assert T.placed(["wandb run 'r1' in project p"], {"wandb": {"id": "x9", "name": "r1", "project": "p"}}) == [
        "wandb run 'r1' (id x9) in project p"]  # (no URL known)
    # a run whose trackers never began (refused, failed before training) keeps the plan's words
    row = run_row("j-20260101-000000-abcd", {"plan.json": json.dumps({"job": "j", "nodes": [], "trackers": said}),
                                              "trackers.json": json.dumps(kept)})
    assert row.trackers == T.placed(said, kept) and row.tracker_runs == kept
    row = run_row("j-20260101-000000-abcd", {"plan.json": json.dumps({"job": "j", "nodes": [], "trackers": said}),
                                              "trackers.json": "{broken"})
    assert row.trackers == said and row.tracker_runs is None


def rank_0_of(run_dir, monkeypatch):
    """The environment rank 0's entry sees on attempt 1 of a run in ``run_dir``, with MLflow's
    file store beside it (MLFLOW_TRACKING_URI set here: mlflow.set_tracking_uri would also set it
    in os.environ for good, seen by every later test's subprocesses) and W&B quiet. WANDB_SERVICE
    set empty here: wandb.init names its service there for good, and a later test's `ftbundle
    run` started from this worker carried it to its ranks."""
    run_dir.mkdir()
    for k in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(k)
    for k, v in {"FTB_RUN_DIR": str(run_dir), "FTB_ATTEMPT": "1", "MLFLOW_ALLOW_FILE_STORE": "true",
                 "MLFLOW_TRACKING_URI": f"file://{run_dir.parent}/mlruns", "WANDB_SILENT": "true",
                 "WANDB_SERVICE": ""}.items():
        monkeypatch.setenv(k, v)
    return run_dir


def test_rank_0_keeps_its_real_tracker_runs_and_a_later_attempt_continues_them(tmp_path, monkeypatch):
    """The entry's record of the real MLflow (a file store) and W&B (offline) runs, and what a
    later attempt's rank 0 sets from it; the job's own choices are kept, other ranks untouched."""
    import mlflow
    import wandb

    from ftbundle.shims import llamafactory_entry as entry

    run_dir = rank_0_of(tmp_path / "run", monkeypatch)
    assert entry.continue_trackers({"RANK": "0"}) == []  # (no record yet: the first attempt)
    wb = wandb.init(mode="offline", dir=str(run_dir), project="p", name="r1")
    try:
        with mlflow.start_run(run_name="r1") as ml:
            entry.keep_tracker_runs()
    finally:
        wb.finish()
    kept = json.loads((run_dir / "trackers.json").read_text())
    assert kept == {"attempt": 1, "began": 1,
                    "mlflow": {"run_id": ml.info.run_id, "name": "r1", "experiment_id": ml.info.experiment_id,
                               "tracking_uri": f"file://{tmp_path}/mlruns"},
                    "wandb": {"id": wb.id, "name": "r1", "project": "p", "entity": None, "url": None,
                              "offline": True, "dir": kept["wandb_dirs"][0]},
                    "wandb_dirs": [str(next((run_dir / "wandb").glob(f"offline-run-*-{wb.id}")))]}

    env = {"RANK": "0", "FTB_ATTEMPT": "2"}
    assert entry.continue_trackers(env) == [f"mlflow run {ml.info.run_id}", f"wandb run {wb.id}"]
    assert env == {"RANK": "0", "FTB_ATTEMPT": "2", "MLFLOW_RUN_ID": ml.info.run_id, "MLFLOW_MAX_LOG_PARAMS": "0",
                   "WANDB_RUN_ID": wb.id, "WANDB_RESUME": "allow"}
    mine = {"RANK": "0", "MLFLOW_RUN_ID": "m", "WANDB_RUN_ID": "w"}
    assert entry.continue_trackers(mine) == [] and mine == {"RANK": "0", "MLFLOW_RUN_ID": "m", "WANDB_RUN_ID": "w"}
    other = {"RANK": "1"}
    assert entry.continue_trackers(other) == [] and other == {"RANK": "1"}
    # the second attempt's record keeps the attempt that began the runs, and both offline directories
    monkeypatch.setenv("FTB_ATTEMPT", "2")
    wb = wandb.init(mode="offline", dir=str(run_dir), project="p", name="r1", id=kept["wandb"]["id"])
    try:
        entry.keep_tracker_runs()  # (MLflow's run has ended: W&B's alone is found, MLflow's stays as kept)
    finally:
        wb.finish()
    again = json.loads((run_dir / "trackers.json").read_text())
    assert again["attempt"] == 2 and again["began"] == 1 and again["mlflow"] == kept["mlflow"]
    assert len(again["wandb_dirs"]) == 2 and again["wandb_dirs"][0] == kept["wandb_dirs"][0]
    assert entry._without_userinfo("http://u:secret@m:5000/x") == "http://m:5000/x"
    assert entry._without_userinfo("databricks") == "databricks"


def test_a_run_resuming_another_runs_checkpoint_continues_its_tracker_runs(tmp_path, monkeypatch, capsys):
    """The record staged for a run that resumes run R's checkpoint (trackers.continued), what its
    rank 0 sets and says from it, and what it keeps once its W&B run is the same."""
    import wandb

    from ftbundle.shims import llamafactory_entry as entry

    kept = {"attempt": 2, "began": 1, "mlflow": {"run_id": "ab12", "name": "R", "experiment_id": "0",
                                                  "tracking_uri": "file:///s/mlruns"},
            "wandb": {"id": "x9", "name": "R", "project": "p", "entity": None, "url": None, "offline": True,
                      "dir": "/s/runs/R/wandb/offline-run-2-x9"},
            "wandb_dirs": ["/s/runs/R/wandb/offline-run-1-x9", "/s/runs/R/wandb/offline-run-2-x9"]}
    assert T.continued(None, "R") is None and T.continued({"attempt": 1, "began": 1}, "R") is None
    record = T.continued(kept, "R")
    assert record == {"from_run": "R", "mlflow": kept["mlflow"], "wandb": kept["wandb"],
                      "wandb_dirs": kept["wandb_dirs"]}
    assert T.continuing(record) == ("trackers: continuing run R's mlflow run ab12 and wandb run x9 (its "
                                    "checkpoint's; a fresh output_dir begins new ones)")
    assert T.placed(["wandb run 'S' in project p"], record) == [
        "wandb offline run 'R' (id x9, continued from run R): `wandb sync /s/runs/R/wandb/offline-run-1-x9 "
        "/s/runs/R/wandb/offline-run-2-x9`"]

    run_dir = rank_0_of(tmp_path / "S", monkeypatch)
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    theirs = client.create_run(client.create_experiment("theirs")).info.run_id  # (R's run, in its store)
    record["mlflow"]["run_id"] = theirs
    (run_dir / "trackers.json").write_text(json.dumps(record))
    # an MLflow run the job's store or experiment cannot go on with is not continued (MLflow would raise
    # at the trainer's start): a new one begins, and why is said; W&B's is continued all the same
    for env, why in (({"MLFLOW_TRACKING_URI": f"file://{tmp_path}/other"},
                      f"file://{tmp_path}/other: MlflowException: Run '{theirs}' not found"),
                     ({"MLFLOW_EXPERIMENT_NAME": "ours"}, "it is not in experiment 'ours', which the job names"),
                     ({"MLFLOW_EXPERIMENT_ID": "0"}, "the job names 0")):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            env = {"RANK": "0", "FTB_ATTEMPT": "1", **env}
            assert entry.continue_trackers(env) == ["wandb run x9"] and "MLFLOW_RUN_ID" not in env
            said = capsys.readouterr().out
            assert f"ftbundle: mlflow run {theirs} is not continued (" in said and why in said, said
    env = {"RANK": "0", "FTB_ATTEMPT": "1", "MLFLOW_EXPERIMENT_NAME": "theirs"}
    assert entry.continue_trackers(env) == [f"mlflow run {theirs}", "wandb run x9"]
    assert env["MLFLOW_RUN_ID"] == theirs and env["WANDB_RUN_ID"] == "x9" and env["WANDB_RESUME"] == "allow"
    assert f"ftbundle: attempt 1 continues mlflow run {theirs} and wandb run x9 (run R's)" in capsys.readouterr().out
    assert mlflow.active_run() is None
    wb = wandb.init(mode="offline", dir=str(run_dir), project="p", name="S", id="x9")
    try:
        entry.keep_tracker_runs()
    finally:
        wb.finish()
    again = json.loads((run_dir / "trackers.json").read_text())
    assert again["from_run"] == "R" and "began" not in again and again["attempt"] == 1
    assert again["wandb_dirs"][:2] == kept["wandb_dirs"] and len(again["wandb_dirs"]) == 3
    assert again["wandb_dirs"][2].startswith(str(run_dir / "wandb" / "offline-run-"))


def test_report_to_all_says_the_trackers_rank_0_has():
    """report_to all (or none on transformers 4) reports to every tracker installed where rank 0
    logs: `runs` says those, not every tracker transformers knows (the probe asked for all)."""
    every_dist = {d: "absent" for dists in T.PACKAGES.values() for d in dists}
    assert T.installed(None) is None and T.installed({"torch": "2.9"}) is None  # (not asked)
    assert T.installed({**every_dist, "wandb": "0.31.0"}) == frozenset({"wandb"})
    assert T.installed({**every_dist, "tensorboardX": "2.6", "mlflow-skinny": "3.17.2"}) == {"tensorboard", "mlflow"}
    assert T.installed(every_dist) == frozenset()
    config = {**LF, "report_to": "all"}
    args = dict(run_dir="/s/runs/r1", run_id="r1", job="j", env={}, workdir="/s", mlflow="3.17.2")
    keys, env, where = T.staged(config, **args, present=frozenset({"tensorboard"}))
    assert where == ["tensorboard /s/runs/r1/tensorboard"] and set(env) == {"TENSORBOARD_LOGGING_DIR"}
    assert T.staged(config, **args, present=frozenset()) == ({}, {}, [])  # (none installed: none used)
    _, _, where = T.staged(config, **args, present=frozenset({"wandb", "clearml"}))
    assert where == ["wandb run 'r1' in project llamafactory", "clearml run 'r1'"]
    _, _, where = T.staged(config, **args)  # (not known: each is said)
    assert [w.split()[0] for w in where] == ["tensorboard", "wandb", "mlflow"]


def test_an_empty_wandb_dir_in_the_jobs_env_is_said_as_the_ranks_see_it():
    """The job's env wins in the ranks' environment: an empty WANDB_DIR leaves W&B its default,
    the working directory, and that is where `runs` says its offline run is."""
    _, env, where = T.staged({**LF, "report_to": "wandb"}, run_dir="/s/runs/r1", run_id="r1", job="j",
                             env={"WANDB_DIR": "", "WANDB_MODE": "offline"}, workdir="/work")
    assert "WANDB_DIR" not in env and where == ["wandb offline run 'r1' in /work/wandb (`wandb sync` it)"]


def test_rank_0s_probe_knocks_on_its_trackers_servers(monkeypatch):
    """The probe's TCP connect to each place a tracker would log to, on real sockets: a server
    listening here answers; a closed port, a name that never resolves (.invalid) do not; W&B's
    cloud under both its names where nothing else is named; nothing is tried offline or behind a
    proxy. The job's URL travels without its user, password and path."""
    import socket

    from ftbundle.remote import probe_trackers as probe

    assert probe.endpoint("https://u:p@mlflow.corp/api") == ("mlflow.corp", 443)
    assert probe.endpoint("http://10.0.0.5:5000") == ("10.0.0.5", 5000)
    assert probe.endpoint("http://[::1]:5000/x") == ("::1", 5000)
    assert probe.endpoint("file:///shared/mlruns") is None and probe.endpoint("databricks") is None
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    up = f"http://127.0.0.1:{server.getsockname()[1]}"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # (bound, never listening: refused)
    down = f"http://127.0.0.1:{closed.getsockname()[1]}"
    try:
        asked = {"wandb": {"url": up, "mode": None}, "mlflow": {"set": True, "url": down}}
        found = probe.servers(asked, {})
        assert found == {"wandb": {up[7:]: "ok"}, "mlflow": {down[7:]: "Connection refused"}}
        found = probe.servers({"wandb": {"url": None, "mode": None}}, {"WANDB_BASE_URL": "https://wandb.invalid"})
        assert found == {"wandb": {"wandb.invalid:443": "name not resolved"}}
        # nothing named: W&B's cloud under both its names (the settings file's base_url when the host has one)
        assert set(probe.servers({"wandb": {"url": None, "mode": None}}, {})["wandb"]) == {
            "api.forge.coreweave.com:443", "api.wandb.ai:443"}
        assert probe.servers({"wandb": {"url": None, "mode": None}}, {}, up) == {"wandb": {up[7:]: "ok"}}
        # the host's own MLflow URI where the job sets none; none at all: nothing to knock on
        assert probe.servers({"mlflow": {"set": False, "url": None}}, {"MLFLOW_TRACKING_URI": up}) == {
            "mlflow": {up[7:]: "ok"}}
        assert probe.servers({"mlflow": {"set": True, "url": None}}, {"MLFLOW_TRACKING_URI": up}) == {}
        assert probe.servers({"mlflow": {"set": False, "url": None}}, {}) == {}
        # offline (the job's mode wins), a proxy (the job's or the host's): not tried
        assert probe.servers({"wandb": {"url": down, "mode": None}}, {"WANDB_MODE": "offline"}) == {}
        assert probe.servers({"wandb": {"url": down, "mode": "online"}}, {"WANDB_MODE": "offline"}) == {
            "wandb": {down[7:]: "Connection refused"}}
        assert probe.servers({"wandb": {"url": down, "mode": None}}, {"https_proxy": "http://p:3128"}) == {
            "proxy": "https_proxy"}
        assert probe.servers({"mlflow": {"set": True, "url": down}, "proxies": ["HTTPS_PROXY"]}, {}) == {
            "proxy": "HTTPS_PROXY"}
    finally:
        server.close()
        closed.close()

    asked = T.servers_asked({**LF, "report_to": ["wandb", "mlflow"]},
                            {"WANDB_BASE_URL": "https://wandb.corp/x", "MLFLOW_TRACKING_URI": "https://u:pw@m:5000/a"})
    assert asked == {"wandb": {"url": "https://wandb.corp", "mode": None}, "mlflow": {"set": True, "url": "https://m:5000"}}
    assert T.servers_asked({**LF, "report_to": "wandb"}, {"WANDB_MODE": "offline"}) is None
    assert T.servers_asked({**LF, "report_to": "tensorboard"}, {}) is None
    assert T.servers_asked({**LF, "report_to": "mlflow"}, {"MLFLOW_TRACKING_URI": "file:///s/mlruns",
                                                           "HTTPS_PROXY": "http://p"}) == {
        "mlflow": {"set": True, "url": None}, "proxies": ["HTTPS_PROXY"]}


def test_a_trackers_server_rank_0_does_not_reach_is_refused(tmp_path):
    """The check names rank 0's host and what its probe saw at each place; silent where one
    place answered, where nothing was tried, where W&B runs offline or is not installed, and
    for W&B after a missing key (said first: the key is the first thing to mend)."""
    from ftbundle.check import probe_spec
    from tests.unit.test_check_unit import facts

    layout = layout_of(tmp_path, 2, train={"llamafactory": {**LF, "report_to": ["wandb", "mlflow"]}},
                       env={"MLFLOW_TRACKING_URI": "http://localhost:5000"})
    assert probe_spec(layout, 0, token=None, expect=[0, 1], port_peers=None)["servers"] == {
        "wandb": {"url": None, "mode": None}, "mlflow": {"set": True, "url": "http://localhost:5000"}}
    assert "servers" not in probe_spec(layout, 1, token=None, expect=[0, 1], port_peers=None)

    versions = {**BASE, "wandb": "0.31.0", "mlflow": "3.17.2", "mlflow-skinny": "absent"}
    keyed = {"netrc": "/root/.netrc", "machines": ["api.forge.coreweave.com"], "settings_key": False}
    cloud = {"api.forge.coreweave.com:443": "name not resolved", "api.wandb.ai:443": "name not resolved"}

    def fleet(servers, login=keyed, env=None):
        return [facts("node0", versions=versions, wandb_login=login, env=env or {}, servers=servers),
                facts("node1", 1, versions=versions)]

    job = {"env": {"MLFLOW_TRACKING_URI": "http://localhost:5000"}}
    c = judged(tmp_path, ["wandb", "mlflow"], fleet({"wandb": cloud, "mlflow": {"localhost:5000": "Connection refused"}}),
               **job)
    assert c.failure == "tracker cannot log"
    assert c.details == [
        "wandb (report_to) cannot reach its server from node0, where rank 0 logs: api.forge.coreweave.com:443 name "
        "not resolved, api.wandb.ai:443 name not resolved: wandb.init gives up after its init_timeout (90 s), once "
        "the model is loaded",
        "(WANDB_MODE: offline in the job's env keeps the run in the run directory, for `wandb sync` from a host that "
        "reaches W&B; behind a proxy, set HTTPS_PROXY in the job's env)",
        "mlflow (report_to) cannot reach its tracking server from node0, where rank 0 logs: localhost:5000 "
        "Connection refused: MLflow's first call fails after its retries (4 min against a closed port), once the "
        "model is loaded",
        "(set MLFLOW_TRACKING_URI in the job's env to an address rank 0's host reaches: localhost there is not the "
        "launcher's)"]
    half = {"api.forge.coreweave.com:443": "ok", "api.wandb.ai:443": "name not resolved"}
    for servers in ({"wandb": half}, {"proxy": "HTTPS_PROXY"}, {}, None):
        assert judged(tmp_path, ["wandb", "mlflow"], fleet(servers), **job).ok
    assert judged(tmp_path, "wandb", fleet({"wandb": cloud}, env={"WANDB_MODE": "offline"})).ok
    assert judged(tmp_path, "tensorboard", fleet({"wandb": cloud})).ok  # (not reported to)
    bare = {"netrc": "/root/.netrc", "machines": None, "settings_key": False, "netrc_error": "No such file"}
    c = judged(tmp_path, "wandb", fleet({"wandb": cloud}, login=bare))
    assert len(c.details) == 2 and "has no API key on node0" in c.details[0]  # (the key first, alone)
    absent = [facts("node0", versions={**versions, "wandb": "absent"}, wandb_login=keyed, servers={"wandb": cloud})]
    assert "cannot reach" not in " ".join(judged(tmp_path, "wandb", absent).details)


def test_a_failed_sends_reason_is_its_innermost_cause_without_urls():
    """MLflow's queue logs a failed send with the whole chain of urllib3's exceptions; the warning
    names the cause a user can act on. Messages as MLflow 3 printed them (the second from a CI run:
    the server went away while the client's kept-alive connection was open; the old reason cut it
    mid-word, "ool(host=...")."""
    from ftbundle.shims import llamafactory_entry as entry

    head = ("Run Id 92005: Failed to log run data: Exception: API request to http://ann:pw@127.0.0.1:42167/api/2.0/"
            "mlflow/runs/log-batch failed with exception HTTPConnectionPool(host='127.0.0.1', port=42167): Max "
            "retries exceeded with url: /api/2.0/mlflow/runs/log-batch (Caused by ")
    refused = head + ("NewConnectionError('<urllib3.connection.HTTPConnection object at 0x7f>: Failed to establish "
                      "a new connection: [Errno 111] Connection refused'))")
    reset = head + "ProtocolError('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer')))"
    dropped = head + ("ProtocolError('Connection aborted.', RemoteDisconnected('Remote end closed connection "
                      "without response')))")
    assert entry._why(refused) == "[Errno 111] Connection refused"
    assert entry._why(reset) == "[Errno 104] Connection reset by peer"
    assert entry._why(dropped) == "RemoteDisconnected: Remote end closed connection without response"
    status = ("Run Id 1: Failed to log run data: Exception: API request to http://ann:pw@h/api/2.0/mlflow/runs/"
              "log-batch failed with error code 503 != 200. Response body: '" + "busy " * 60 + "'")
    why = entry._why(status)
    assert why.startswith("...busy ") and len(why) <= 204 and "pw" not in why and "http" not in why, why
    short = "Run Id 1: Failed to log run data: Exception: API request to http://ann:pw@h/x failed: 500"
    assert entry._why(short) == "API request to <url> failed: 500"


def test_a_job_on_localhost_does_not_log_through_the_launchers_own_wandb_service(tmp_path, monkeypatch, capfd):
    """A launcher started by a process that called wandb.init (a notebook; wandb names its live
    service in WANDB_SERVICE): a job on localhost inherits the launcher's environment, but not
    that. Its rank 0 logged through the notebook's service, which kept a killed rank's W&B run
    open, and the restart's rank 0 was refused the run id (wandb 0.31: 'run ID ... is in use')."""
    import wandb

    from ftbundle.cli import main
    from tests.support.helpers import free_port

    monkeypatch.setenv("WANDB_SERVICE", "")  # (the test's end removes what wandb sets)
    monkeypatch.setenv("FTB_TEST_INHERITED", "from-the-launcher")
    wandb.teardown()  # (a service an earlier wandb.init of this process left is not named again)
    wandb.setup()
    try:
        assert os.environ["WANDB_SERVICE"]
        job = tmp_path / "job.yaml"
        job.write_text(f"name: svc\nshared_dir: .s\nmaster_port: {free_port()}\n"
                       "train: {command: 'echo service=${WANDB_SERVICE-unset} inherited=$FTB_TEST_INHERITED'}\n")
        assert main(["run", "-v", str(job)]) == 0
    finally:
        wandb.teardown()
    assert "service=unset inherited=from-the-launcher" in capfd.readouterr().out
