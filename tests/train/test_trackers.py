"""Experiment trackers (issue 47 item 4) with their real clients on a real LlamaFactory LoRA (2
ranks, localhost): MLflow (mlflow-skinny on the ranks; a file store, and a real `mlflow server`
from .venv-mlflow) and W&B offline; a run's attempts and a resuming run continue one tracker run;
a tracker server that goes away holds neither the run's end nor its saved model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import free_port
from tests.train.test_quickstart import REPO, quickstart_copy, tiny_model  # noqa: F401 - the session's tiny model

pytestmark = pytest.mark.train


def test_the_check_judges_the_mlruns_an_earlier_mlflow_left_in_the_workdir(tmp_path, tiny_model):
    """A workdir where MLflow before 3.7 kept its runs (./mlruns, its default then) keeps that
    file store as MLflow's default when the job names no URI: MLflow 3.13+ refuses it at the first
    log without the opt-in. Rank 0's real probe finds it; the check says so (exit 2, nothing
    started), and with the opt-in it passes: with mlflow-skinny, as here, the check refused that
    before as a database it cannot write."""
    job = quickstart_copy(tmp_path, tiny_model, report_to="mlflow", max_steps=2)
    work = job.parent
    quiet = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    made = subprocess.run([sys.executable, "-c", "import mlflow; mlflow.set_tracking_uri('file:./mlruns'); "
                           "mlflow.start_run(); mlflow.end_run()"], capture_output=True, text=True, timeout=120,
                          cwd=work, env={**quiet, "MLFLOW_ALLOW_FILE_STORE": "true"})
    assert made.returncode == 0 and any((work / "mlruns").glob("*/meta.yaml")), made.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], capture_output=True, text=True,
                          timeout=300, env=quiet)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (f"refuses the file store {work}/mlruns (MLflow's default with no MLFLOW_TRACKING_URI: it holds runs "
            "already) unless MLFLOW_ALLOW_FILE_STORE is true") in proc.stderr, proc.stderr[-3000:]
    assert "cannot write sqlite" not in proc.stderr and not (work / ".shared/runs").exists()
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "check", str(job)], capture_output=True, text=True,
                          timeout=300, env={**quiet, "MLFLOW_ALLOW_FILE_STORE": "true"})  # (rank 0's login env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_wandb_offline_typed_in_the_workdir_passes_the_check_without_a_key(tmp_path, tiny_model):
    """`wandb offline` in the job's workdir (./wandb/settings) keeps W&B offline for the ranks,
    which run there (wandb.init reads it whatever WANDB_DIR says): rank 0's real probe reads it,
    and the check asks for no key and no server; `wandb online` there and the refusal is back."""
    job = quickstart_copy(tmp_path, tiny_model, report_to="wandb", max_steps=2)
    work, home = job.parent, tmp_path / "home"
    home.mkdir()
    quiet = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_")) and k != "NETRC"},
             "HOME": str(home)}
    wandb = str(Path(sys.executable).parent / "wandb")
    for mode, code in (("offline", 0), ("online", 2)):
        subprocess.run([wandb, mode], capture_output=True, text=True, timeout=120, cwd=work, env=quiet, check=True)
        proc = subprocess.run([sys.executable, "-m", "ftbundle", "check", str(job)], capture_output=True, text=True,
                              timeout=300, env=quiet)
        assert proc.returncode == code, (mode, proc.stdout[-3000:] + proc.stderr[-2000:])
    assert "wandb (report_to) has no API key on localhost" in proc.stdout


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (run-<id>.wandb), as wandb writes them: a 7-byte header
    (":W&B", magic, version), then LevelDB's log format: 32 KiB blocks of chunks, each with a
    7-byte header (CRC, length, type: 1 whole, 2 first, 3 middle, 4 last); a chunk header that
    does not fit in a block's tail leaves it as padding. wandb 0.31 ships no reader of its own."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    records, part, at = [], b"", 7
    while at + 7 <= len(data):
        left = block - at % block
        if left < 7:
            at += left
            continue
        length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
        chunk, at = data[at + 7:at + 7 + length], at + 7 + length
        if kind == 0 and length == 0:  # (zeros: the rest of a block, or the end)
            continue
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
    return records


def wandb_reachable() -> bool:
    """Whether this machine reaches W&B's cloud (either of its names) by TCP."""
    import socket

    for host in ("api.forge.coreweave.com", "api.wandb.ai"):
        try:
            socket.create_connection((host, 443), 3).close()
            return True
        except OSError:
            pass
    return False


def test_a_lora_reporting_to_mlflow_and_wandb_reaches_both_under_its_run_id(tmp_path, tiny_model, monkeypatch):
    """Issue 47 item 4 with the real MLflow and W&B clients (mlflow-skinny and wandb, as `make
    test` installs them), neither needing a network: MLflow to a file store on shared storage,
    W&B offline. First the job as most users would first write it, no MLFLOW_TRACKING_URI: with
    mlflow-skinny that is MLflow's default sqlite store, which it cannot write (the first log
    would fail after the model is loaded): the check refuses it, nothing starts. Then with a
    store: each tracker holds the run under the run's id, tagged with the job, with rank 0's
    losses step by step; W&B's offline run lies in the run directory, and `runs` says both."""
    from mlflow.tracking import MlflowClient

    job = quickstart_copy(tmp_path, tiny_model, report_to=["mlflow", "wandb"], max_steps=6)
    work = job.parent
    home = tmp_path / "home"  # (a user who never ran `wandb login` here)
    home.mkdir()
    quiet = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_")) and k != "NETRC"}
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], capture_output=True, text=True,
                          timeout=600, env={**quiet, "HOME": str(home)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "cannot write sqlite:///mlflow.db (MLflow's default store)" in proc.stderr, proc.stderr[-3000:]
    assert (f"wandb (report_to) has no API key on localhost, where rank 0 logs: no WANDB_API_KEY in the job's env, "
            f"its env file or the login environment, no {home}/.netrc, and WANDB_MODE is not offline") in proc.stderr
    assert not (work / ".shared/runs").exists() or not any((work / ".shared/runs").iterdir())

    store = work / ".shared/mlruns"
    # the real `wandb login` writes the key to ~/.netrc (wandb 0.31: for its default server,
    # api.forge.coreweave.com): the check reads that the entry is there (not the key); a tracking
    # URI in the login environment (a shell profile's) counts as the job's would
    login = subprocess.run([str(Path(sys.executable).parent / "wandb"), "login", "--no-verify", "0" * 40],
                           capture_output=True, text=True, timeout=120, env={**quiet, "HOME": str(home)})
    assert login.returncode == 0 and (home / ".netrc").exists(), login.stdout + login.stderr
    # a file store (a cluster without an MLflow server): MLflow 3.13+ refuses it without the opt-in,
    # as the real client does at its first run
    filed = {**quiet, "HOME": str(home), "MLFLOW_TRACKING_URI": f"file://{store}"}
    client = subprocess.run([sys.executable, "-c", "import mlflow; mlflow.start_run()"], capture_output=True,
                            text=True, timeout=120, env=filed)
    assert client.returncode != 0 and "is in maintenance mode" in client.stderr, client.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "check", str(job)], capture_output=True, text=True,
                          timeout=300, env=filed)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"on localhost refuses the file store file://{store} unless MLFLOW_ALLOW_FILE_STORE is true" in proc.stdout
    assert "has no API key" not in proc.stdout  # (W&B's login is there now)
    allowed = {**filed, "MLFLOW_ALLOW_FILE_STORE": "true"}
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "check", str(job)], capture_output=True, text=True,
                          timeout=300, env=allowed)
    assert "0" * 40 not in proc.stdout + proc.stderr and "has no API key" not in proc.stdout  # (logged in now)
    if not wandb_reachable():  # (this machine's network, as rank 0's probe finds it: W&B online would
        # give up after wandb.init's 90 s, seen here: "Timed out while retrying ... no such host")
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("wandb (report_to) cannot reach its server from localhost, where rank 0 logs: "
                "api.forge.coreweave.com:443 ") in proc.stdout, proc.stdout[-3000:]
        proc = subprocess.run([sys.executable, "-m", "ftbundle", "check", str(job)], capture_output=True,
                              text=True, timeout=300, env={**allowed, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    spec = yaml.safe_load(job.read_text())
    spec["env"].update({"MLFLOW_TRACKING_URI": f"file://{store}", "MLFLOW_ALLOW_FILE_STORE": "true",
                        "WANDB_MODE": "offline", "WANDB_SILENT": "true"})  # (no network here: W&B offline)
    job.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = next((work / ".shared/runs").iterdir())
    logged = [json.loads(line) for line in (work / ".shared/output/quickstart-lora/trainer_log.jsonl")
              .read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    assert [r["current_steps"] for r in logged] == list(range(1, 7))

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (as the job's env allows it to the ranks)
    client = MlflowClient(tracking_uri=f"file://{store}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert found.info.run_name == run.name and found.info.status == "FINISHED"
    assert found.data.tags["ftbundle.job"] == "quickstart-lora" and found.data.tags["ftbundle.run"] == run.name
    history = client.get_metric_history(found.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 7))
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in logged], abs=1e-3)

    (offline,) = (run / "wandb").glob("offline-run-*/run-*.wandb")  # (rank 0's run alone, in the run directory)
    records = wandb_records(offline)
    (begun,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert begun.display_name == run.name and begun.project == "llamafactory"
    assert list(begun.tags) == ["ftbundle", "quickstart-lora"] and begun.run_group == "quickstart-lora"
    steps = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
             for r in records if r.WhichOneof("record_type") == "history"]
    losses = [(s["train/global_step"], s["train/loss"]) for s in steps if "train/loss" in s]
    assert [step for step, _ in losses] == list(range(1, 7))
    assert [loss for _, loss in losses] == pytest.approx([r["loss"] for r in logged], abs=1e-3)

    rows = json.loads(subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"],
                                     capture_output=True, text=True, timeout=120).stdout)
    # the runs rank 0 logged to, as it kept them once training began (the plan's words before)
    assert rows[0]["trackers"] == [
        f"wandb offline run {run.name!r} (id {begun.run_id}): `wandb sync {offline.parent}`",
        f"mlflow run {run.name!r} (id {found.info.run_id}, experiment {found.info.experiment_id}) at file://{store}"]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["trackers"] == [f"wandb offline run {run.name!r} in {run}/wandb (`wandb sync` it)",
                                f"mlflow run {run.name!r} at file://{store}"]


def rank_processes(run_id: str, attempt: int) -> dict[str, int]:
    """{RANK: pid} of this machine's ranks of one attempt of a run (FTB_JOB RUN.aN-NODE, RANK in
    their environment, the LlamaFactory entry in their command line)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in v)
            argv = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if env.get("FTB_JOB", "").startswith(f"{run_id}.a{attempt}-") and "ftb_llamafactory.py" in argv \
                and "RANK" in env:
            found[env["RANK"]] = int(proc.name)
    return found


def tracked_job(tmp_path: Path, model: Path, mlflow: str | None = None, **keys) -> Path:
    """The quickstart reporting to MLflow (``mlflow``: a tracking server's URL; else a file store
    on shared storage) and W&B (offline), 40 steps with a checkpoint every 4; ``keys``: the job's
    own (restarts)."""
    job = quickstart_copy(tmp_path, model, report_to=["mlflow", "wandb"], max_steps=40, save_steps=4,
                          save_total_limit=3)
    spec = yaml.safe_load(job.read_text())
    spec.update(keys)
    store = {"MLFLOW_TRACKING_URI": f"file://{job.parent}/.shared/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}
    spec["env"].update({"MLFLOW_TRACKING_URI": mlflow} if mlflow else store)
    spec["env"].update({"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    job.write_text(yaml.safe_dump(spec))
    return job


def run_killing_rank_1(job: Path):
    """`ftbundle run JOB` whose first attempt's rank 1 is killed (SIGKILL) once checkpoint-4 is
    saved and rank 0 has kept its trackers' runs: (the process, its stdout, its stderr)."""
    work = job.parent
    before = set((work / ".shared/runs").glob("*")) if (work / ".shared/runs").exists() else set()
    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", str(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    output = work / ".shared/output/quickstart-lora"
    killed = None
    try:
        deadline = time.monotonic() + 300
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            runs = [r for r in (work / ".shared/runs").glob("quickstart-lora-*") if r not in before]
            ranks = rank_processes(runs[0].name, 1) if runs else {}
            if (output / "checkpoint-4/trainer_state.json").exists() and "1" in ranks \
                    and (runs[0] / "trackers.json").exists() and "began" in (runs[0] / "trackers.json").read_text():
                os.kill(ranks["1"], signal.SIGKILL)  # (rank 1 dies: torchrun ends the node)
                killed = ranks["1"]
            time.sleep(0.2)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "the first attempt ended before its checkpoint-4 and its trackers were seen"
    return proc, out, err


class MlflowServer:
    """A running `mlflow server`: its URL, and stop() (SIGKILL: a server that goes away)."""

    def __init__(self, url: str, process: subprocess.Popen):
        self.url, self.process = url, process

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server (the full `mlflow` package in .venv-mlflow, which `make test`
    makes: .ci/mlflow-venv.sh) on a free port of this machine, its store a SQLite database and its
    artifacts in tmp_path (MlflowServer). Stopped after the test."""
    mlflow = REPO / ".venv-mlflow" / "bin" / "mlflow"
    assert mlflow.exists(), f"{mlflow} is missing: `make test` makes it (.ci/mlflow-venv.sh)"
    port = free_port()
    log = (tmp_path / "mlflow-server.log").open("w")
    server = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow-server.db",
                               "--default-artifact-root", str(tmp_path / "mlflow-artifacts")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while server.poll() is None and time.monotonic() < deadline:
            if subprocess.run(["curl", "-sf", f"{url}/health"], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the MLflow server did not answer: {(tmp_path / 'mlflow-server.log').read_text()[-2000:]}")
        yield MlflowServer(url, server)
    finally:
        MlflowServer(url, server).stop()
        log.close()


@pytest.fixture
def wandb_service_here(monkeypatch):
    """A live wandb service of this process, named in its WANDB_SERVICE as wandb.init leaves it
    (a notebook that logged to W&B, then started `ftbundle run`); torn down after the test."""
    import wandb

    monkeypatch.setenv("WANDB_SERVICE", "")  # (the test's end removes what wandb sets)
    wandb.teardown()  # (a service an earlier wandb.init of this process left is not named again)
    wandb.setup()
    assert os.environ["WANDB_SERVICE"]
    yield os.environ["WANDB_SERVICE"]
    wandb.teardown()


def test_a_restarted_lora_continues_its_mlflow_and_wandb_runs(tmp_path, tiny_model, mlflow_server,
                                                               wandb_service_here):
    """A run's later attempt (here a restart after a rank was killed) logs to the MLflow and W&B
    runs its first attempt began, not to new ones: one MLflow run on the tracking server whose
    loss history goes on from the checkpoint the restart resumed, one W&B run id across both
    attempts' offline directories (`wandb sync` syncs the files of one run in order), and `runs`
    says the runs rank 0 kept. The launcher is started with its own process's wandb service in
    its environment: the ranks on localhost do not log through it (attempt 1's killed rank 0
    left its W&B run open there, and wandb 0.31 refused attempt 2's rank 0 the same run id)."""
    from mlflow.tracking import MlflowClient

    job = tracked_job(tmp_path, tiny_model, mlflow=mlflow_server.url, restarts=1)
    work = job.parent
    proc, out, err = run_killing_rank_1(job)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "restarting all nodes (restart 1 of 1)" in err, err[-3000:]
    (run,) = (work / ".shared/runs").iterdir()
    kept = json.loads((run / "trackers.json").read_text())
    assert kept["attempt"] == 2 and kept["began"] == 1
    assert (f"attempt 2 continues mlflow run {kept['mlflow']['run_id']} and wandb run {kept['wandb']['id']} "
            "(begun by attempt 1)") in (run / "node-0-localhost.a2.log").read_text()
    # the params are the first attempt's: the restart's differ (LlamaFactory sets resume_from_checkpoint),
    # and MLflow refuses a changed value (an ERROR line, the batch of params dropped): not logged again
    assert "Changing param values is not allowed" not in (run / "node-0-localhost.a2.log").read_text()
    # a server that answers: no word of it (the failed-send and exit-wait warnings stay silent)
    assert "mlflow cannot send" not in err and "its exit waits" not in err and "waited" not in err, err[-3000:]

    client = MlflowClient(tracking_uri=mlflow_server.url)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # (one run, not two)
    assert found.info.run_id == kept["mlflow"]["run_id"] and found.info.status == "FINISHED"
    assert found.info.run_name == run.name and found.data.params["max_steps"] == "40"
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "loss")]
    resumed = int(re.search(r"resuming from checkpoint-(\d+)", err).group(1))
    assert steps[-(40 - resumed):] == list(range(resumed + 1, 41)), steps  # (the restart's, from its checkpoint)
    assert set(steps) == set(range(1, 41)) and max(steps[:-(40 - resumed)]) >= resumed  # (the first's before)

    dirs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and kept["wandb_dirs"] == [str(d) for d in dirs]  # (one a attempt, in order)
    ids = {r.run.run_id for d in dirs for r in wandb_records(next(d.glob("run-*.wandb")))
           if r.WhichOneof("record_type") == "run"}
    assert ids == {kept["wandb"]["id"]}

    rows = json.loads(subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"],
                                     capture_output=True, text=True, timeout=120).stdout)
    assert rows[0]["trackers"] == [
        f"wandb offline run {run.name!r} (id {kept['wandb']['id']}, attempts 1-2): `wandb sync {dirs[0]} {dirs[1]}`",
        f"mlflow run {run.name!r} (id {found.info.run_id}, experiment {found.info.experiment_id}, attempts 1-2) "
        f"at {mlflow_server.url}"]
    assert rows[0]["tracker_runs"] == kept


def test_a_run_resuming_a_failed_runs_checkpoint_continues_its_mlflow_and_wandb_runs(tmp_path, tiny_model,
                                                                                     monkeypatch):
    """The usual way on after a crash: the same job run again resumes the failed run's newest
    checkpoint, and logs on into that run's MLflow run and W&B run id (the next run's name and
    tags on them), said before launch; `runs` says which run they came from."""
    from mlflow.tracking import MlflowClient

    job = tracked_job(tmp_path, tiny_model)  # (restarts: 0: rank 1's death ends the run)
    work = job.parent
    store = work / ".shared/mlruns"
    proc, out, err = run_killing_rank_1(job)
    assert proc.returncode != 0, out[-2000:] + err[-3000:]
    (first,) = (work / ".shared/runs").iterdir()
    kept = json.loads((first / "trackers.json").read_text())

    check = subprocess.run([sys.executable, "-m", "ftbundle", "check", str(job)], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0 and (f"trackers: continuing run {first.name}'s mlflow run "
                                      f"{kept['mlflow']['run_id']}") in check.stdout, check.stdout[-3000:]
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    resumed = int(re.search(rf"resuming from checkpoint-(\d+) of 40 in \S+ \(written by run {first.name}\)",
                            proc.stderr).group(1))
    assert (f"trackers: continuing run {first.name}'s mlflow run {kept['mlflow']['run_id']} and wandb run "
            f"{kept['wandb']['id']}") in proc.stderr, proc.stderr[-3000:]
    (second,) = [r for r in (work / ".shared/runs").iterdir() if r != first]
    assert (f"continues mlflow run {kept['mlflow']['run_id']} and wandb run {kept['wandb']['id']} (run "
            f"{first.name}'s)") in (second / "node-0-localhost.a1.log").read_text()

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file://{store}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # (one run, not two)
    assert found.info.run_id == kept["mlflow"]["run_id"] and found.info.status == "FINISHED"
    assert found.info.run_name == second.name and found.data.tags["ftbundle.run"] == second.name
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "loss")]
    assert steps[-(40 - resumed):] == list(range(resumed + 1, 41)), steps
    assert set(steps) == set(range(1, 41))

    dirs = [next(first.glob("wandb/offline-run-*")), next(second.glob("wandb/offline-run-*"))]
    ids = {r.run.run_id for d in dirs for r in wandb_records(next(d.glob("run-*.wandb")))
           if r.WhichOneof("record_type") == "run"}
    assert ids == {kept["wandb"]["id"]}
    rows = json.loads(subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"],
                                     capture_output=True, text=True, timeout=120).stdout)
    assert [r["run_id"] for r in rows] == [first.name, second.name]
    assert rows[1]["trackers"] == [
        f"wandb offline run {second.name!r} (id {kept['wandb']['id']}, continued from run {first.name}): "
        f"`wandb sync {dirs[0]} {dirs[1]}`",
        f"mlflow run {second.name!r} (id {found.info.run_id}, experiment {found.info.experiment_id}, continued from "
        f"run {first.name}) at file://{store}"]


def test_a_lora_whose_mlflow_server_goes_away_saves_its_adapter_and_ends(tmp_path, tiny_model, mlflow_server):
    """An MLflow server that stops answering mid-run (stopped for an upgrade, a crash) must not
    hold the run's end: MLflow retries each queued send for about 4 minutes, and transformers ends
    the MLflow run (waiting for every send) when training ends, before the model is saved. On the
    code before this test the run sat at "step 40/40" past 10 minutes with its adapter unsaved.
    Here it saves its adapter, waits FTB_TRACKERS_END_S (20 s) for the server, says on what it
    waited, and finishes; the MLflow run holds what was sent before the server went."""
    from mlflow.tracking import MlflowClient

    job = tracked_job(tmp_path, tiny_model, mlflow=mlflow_server.url)
    spec = yaml.safe_load(job.read_text())
    spec["env"]["FTB_TRACKERS_END_S"] = "20"
    job.write_text(yaml.safe_dump(spec))
    work, output = job.parent, job.parent / ".shared/output/quickstart-lora"
    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", str(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (output / "checkpoint-8").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        (run,) = (work / ".shared/runs").iterdir()
        kept = json.loads((run / "trackers.json").read_text())  # (the MLflow run began: rank 0 kept it)
        client = MlflowClient(tracking_uri=mlflow_server.url)
        assert client.get_run(kept["mlflow"]["run_id"]).info.status == "RUNNING"
        mlflow_server.stop()
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended_in = time.monotonic() - stopped
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert (output / "adapter_model.safetensors").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["steps"] == 40
    assert re.search(rf"rank 0 finished and saved, and waited \d+ s \(FTB_TRACKERS_END_S\) on mlflow's server "
                     rf"{mlflow_server.url} \(Connection refused", err), err[-3000:]
    assert ended_in < 200, ended_in  # (the 20 s, not MLflow's retries: each failed send alone takes about 4 min)


SENDER = """
import os, sys, time
sys.path.insert(0, os.environ["SHIMS"])
import mlflow
import llamafactory_entry as entry
entry._end_mlflow_at_exit()
mlflow.set_tracking_uri(os.environ["URL"])
run = mlflow.start_run(run_name="sends")
mlflow.log_metrics({"loss": 1.0}, step=1, synchronous=False)
mlflow.flush_async_logging()
print("RUN", run.info.run_id, flush=True)
sys.stdin.readline()  # (the server is stopped now)
mlflow.log_metrics({"loss": 0.5}, step=2, synchronous=False)
deadline = time.monotonic() + 60
while not entry._SENDS.failed and time.monotonic() < deadline:
    time.sleep(0.2)
print("SAID", time.monotonic(), flush=True)
entry._MLFLOW_END_DEFERRED = True  # (as the trainer's end, deferred, leaves it)
entry.leave(0)
"""


def test_a_failed_mlflow_send_is_said_at_once_and_its_run_end_failing_does_not_fail_the_rank(tmp_path,
                                                                                              mlflow_server):
    """Rank 0's entry with the real MLflow client and server, no trainer: once the server is gone
    the first failed send is said as a warning (with the server and why, never its URL's user),
    and the run's end failing at the rank's exit is said, not raised: the rank leaves with 0. Here
    MLFLOW_HTTP_REQUEST_MAX_RETRIES=0 (a user's choice: sends fail at once), so nothing waits."""
    from mlflow.tracking import MlflowClient

    url = mlflow_server.url.replace("http://", "http://ann:secret@")  # (a user and password in the URI)
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SHIMS": str(REPO / "ftbundle" / "shims"), "URL": url, "RANK": "0",
                                 "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "FTB_TRACKERS_END_S": "60"})
    try:
        run_id = proc.stdout.readline().split()[1]
        assert [m.value for m in MlflowClient(mlflow_server.url).get_metric_history(run_id, "loss")] == [1.0]
        mlflow_server.stop()
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err[-3000:]
    assert "SAID" in out
    # (refused: a new connection; reset: the kept-alive one the server dropped as it stopped, seen in CI)
    assert re.search(re.escape(f"ftbundle: warning: mlflow cannot send this run's metrics to its server "
                               f"({mlflow_server.url}): ") + r"\[Errno (111\] Connection refused|104\] Connection "
                     r"reset by peer)\. " + re.escape("MLflow retries each send for about 4 minutes while training goes "
                                                   "on; the run's end waits at most 60 s for it (FTB_TRACKERS_END_S)"),
                     err), err[-3000:]
    assert err.count("mlflow cannot send") == 1  # (once, however many sends fail)
    assert f"ftbundle: warning: mlflow could not end its run at {mlflow_server.url}: " in err, err[-3000:]
    assert "secret" not in err  # (nor in MLflow's own ERROR line: its record is cut before it is written)
    assert "Failed to log run data: Exception: API request to http://127.0.0.1:" in err
    assert "waited" not in err  # (nothing waited: the sends failed at once)
