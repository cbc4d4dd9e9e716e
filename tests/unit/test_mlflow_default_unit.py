"""MLflow's default store where the job names no tracking URI: from 3.7 a SQLite file in rank 0's
working directory, unless ./mlruns there holds runs already (a user of MLflow before 3.7), where
it stays that file store, which MLflow 3.13+ refuses without MLFLOW_ALLOW_FILE_STORE. Rank 0's
probe looks (remote/probe_trackers.py ``mlruns``), the check and `runs` say the store it finds;
the real client (mlflow-skinny, as `make test` installs it) shows which store it picks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ftbundle import trackers as T
from ftbundle.remote.probe_trackers import mlruns
from tests.unit.test_check_unit import facts
from tests.unit.test_trackers_unit import BASE, LF, judged

ASKED = {"mlflow": {"set": False, "url": None}}  # (the job names no MLFLOW_TRACKING_URI)


def real_mlflow(workdir: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    """The real MLflow client run in ``workdir`` with no tracking URI but ``env``'s."""
    quiet = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run([sys.executable, "-c", f"import mlflow\n{code}"], capture_output=True, text=True,
                          timeout=120, cwd=workdir, env={**quiet, **env})


def test_the_probe_finds_mlruns_holding_runs_as_mlflow_does(tmp_path):
    """A workdir whose ./mlruns the real client filled (under the opt-in) is found; the same
    client there with no URI and no opt-in then refuses its default, the file store; an empty
    ./mlruns, a job's or host's URI, or no workdir: not looked at, or not found."""
    made = real_mlflow(tmp_path, "mlflow.set_tracking_uri('file:./mlruns'); mlflow.start_run(); mlflow.end_run()",
                       MLFLOW_ALLOW_FILE_STORE="true")
    assert made.returncode == 0, made.stderr[-2000:]
    assert mlruns(ASKED, {}, str(tmp_path)) == str(tmp_path / "mlruns")
    used = real_mlflow(tmp_path, "print(mlflow.get_tracking_uri()); mlflow.start_run()")
    assert used.stdout.startswith(f"file://{tmp_path}/mlruns") or used.stdout.startswith(str(tmp_path / "mlruns")), \
        used.stdout
    assert used.returncode != 0 and "is in maintenance mode" in used.stderr, used.stderr[-2000:]

    assert mlruns({"mlflow": {"set": True, "url": "http://ml:5000"}}, {}, str(tmp_path)) is None
    assert mlruns(ASKED, {"MLFLOW_TRACKING_URI": "http://ml:5000"}, str(tmp_path)) is None
    assert mlruns({}, {}, str(tmp_path)) is None and mlruns(ASKED, {}, None) is None
    empty = tmp_path / "empty"
    (empty / "mlruns" / ".trash").mkdir(parents=True)
    assert mlruns(ASKED, {}, str(empty)) is None  # (no experiment: MLflow's default is its SQLite file)
    assert mlruns(ASKED, {}, str(tmp_path / "none")) is None


def test_mlruns_holding_runs_is_judged_as_the_file_store_it_is(tmp_path):
    """No URI and ./mlruns holding runs: MLflow 3.13+ refuses it without the opt-in (said as MLflow's
    default there); with the opt-in it logs, mlflow-skinny too (a file store needs no SQLAlchemy:
    the check refused that before, as if the default were the SQLite file)."""
    held = "/w/mlruns"
    for versions in ({**BASE, "mlflow": "absent", "mlflow-skinny": "3.17.2"},
                     {**BASE, "mlflow": "3.17.2", "mlflow-skinny": "3.17.2"}):
        c = judged(tmp_path, "mlflow", [facts("node0", versions=versions, mlruns=held)])
        assert c.failure == "tracker cannot log"
        assert c.details[0] == (
            "mlflow 3.17.2 on node0 refuses the file store /w/mlruns (MLflow's default with no MLFLOW_TRACKING_URI: "
            "it holds runs already) unless MLFLOW_ALLOW_FILE_STORE is true (from MLflow 3.13: 'The filesystem "
            "tracking backend ... is in maintenance mode'): the first log would stop the run once the model is "
            "loaded"), c.details
        assert len(c.details) == 2  # (and no word of a database)
        assert judged(tmp_path, "mlflow", [facts("node0", versions=versions, mlruns=held)],
                      env={"MLFLOW_ALLOW_FILE_STORE": "true"}).ok
    old = {**BASE, "mlflow": "3.12.1", "mlflow-skinny": "absent"}
    assert judged(tmp_path, "mlflow", [facts("node0", versions=old, mlruns=held)]).ok  # (before the refusal)


def test_runs_says_rank_0s_own_uri_or_its_mlruns_not_mlflows_default():
    """The store `runs` says before rank 0 kept its run: the job's URI, else rank 0's host's (its
    env file or login: said as MLflow's default before), else ./mlruns where that holds runs."""
    mlflow = {**LF, "report_to": "mlflow"}

    def where(env, rank0):
        return T.staged(mlflow, run_dir="/w/runs/r1", run_id="r1", job="j", env=env, workdir="/w", mlflow="3.17.2",
                        rank0_mlflow=rank0)[2]

    assert where({}, ("http://ml:5000", None)) == ["mlflow run 'r1' at http://ml:5000"]
    assert where({"MLFLOW_TRACKING_URI": "http://job:5000"}, ("http://ml:5000", None)) == [
        "mlflow run 'r1' at http://job:5000"]
    assert where({}, (None, "/w/mlruns")) == ["mlflow run 'r1' at /w/mlruns (MLflow's default: it holds runs already)"]
    assert where({}, (None, None))[0].startswith("mlflow run 'r1' at sqlite:////w/mlflow.db (MLflow's default")
