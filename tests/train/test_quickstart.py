"""The main job on the embedded default: a real LlamaFactory LoRA SFT, 2 ranks, localhost."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support import helpers

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"

pytestmark = pytest.mark.train


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama made from the example data (built once per checkout: tests/support/helpers.py)."""
    return helpers.tiny_model()


def quickstart_copy(tmp_path: Path, model: Path, **train_overrides) -> Path:
    """examples/quickstart in tmp_path, pointing at the session's model and this interpreter."""
    work = tmp_path / "quickstart"
    shutil.copytree(QUICKSTART, work, ignore=shutil.ignore_patterns(".shared"))
    train = yaml.safe_load((work / "train.yaml").read_text())
    train["model_name_or_path"] = str(model)
    train.update(train_overrides)
    (work / "train.yaml").write_text(yaml.safe_dump(train))
    job = yaml.safe_load((work / "job.yaml").read_text())
    job["runtime"]["python"] = sys.executable
    job["master_port"] = helpers.free_port()
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    return work / "job.yaml"


def test_quickstart_lora_on_localhost(tmp_path, tiny_model):
    job = quickstart_copy(tmp_path, tiny_model)
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", "-v", str(job)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = job.parent
    adapter = work / ".shared/output/quickstart-lora"
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"

    # rank 0's loss lines were streamed to the terminal, prefixed with host and rank
    loss_lines = [line for line in proc.stdout.splitlines() if "{'loss'" in line]
    assert len(loss_lines) >= 10, proc.stdout[-2000:]
    bad = [line for line in loss_lines if not line.startswith("[localhost r0] {'loss'")]
    assert not bad, bad[:3]
    assert "world size: 2" in proc.stdout
    assert "effective batch size 8" in proc.stderr

    # the run directory holds the node log and the plan
    runs = list((work / ".shared/runs").iterdir())
    assert len(runs) == 1
    run = runs[0]
    assert "{'loss'" in (run / "node-0-localhost.a1.log").read_text()
    plan = json.loads((run / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["nodes"][0]["env"]["NODE_RANK"] == "0"
    assert (run / "node-0.a1.exit").read_text().strip() == "0"
    assert not (run / "diverged.a1").exists()  # (a healthy LoRA's records: the divergence watch said nothing)


def test_a_lora_reporting_to_tensorboard_logs_its_loss_under_its_run_directory(tmp_path, tiny_model):
    """Issue 47 item 4 with a real tracker: `report_to: tensorboard` (TensorBoard installed, as
    `make test` installs it). The events land under the run directory on shared storage, named by
    the run's id, with rank 0's losses as the trainer logged them, and `runs` says where."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = quickstart_copy(tmp_path, tiny_model, report_to="tensorboard", max_steps=8)
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    work = job.parent
    run = next((work / ".shared/runs").iterdir())
    board = run / "tensorboard"
    events = list(board.glob("events.out.tfevents.*"))
    assert len(events) == 1, list(board.iterdir()) if board.exists() else f"no {board}"  # (rank 0's writer alone)
    acc = EventAccumulator(str(board), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    losses = acc.Scalars("train/loss")
    logged = [json.loads(line) for line in (work / ".shared/output/quickstart-lora/trainer_log.jsonl")
              .read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    assert [e.step for e in losses] == [r["current_steps"] for r in logged] == list(range(1, 9))
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in logged], abs=1e-3)
    args = json.loads(acc.Tensors("args/text_summary")[0].tensor_proto.string_val[0])
    assert args["run_name"] == run.name
    rows = json.loads(subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"], capture_output=True,
                                     text=True, timeout=120).stdout)
    assert rows[0]["trackers"] == [f"tensorboard {board}"]


def test_a_detached_loras_told_end_says_its_loss_tokens_and_hosts_as_runs_does(tmp_path, tiny_model):
    """A detached run has no launcher to write summary.json: rank 0's watcher tells `notify:` its
    end. It told the state alone (no hosts, no loss, no tokens/s, which an attached run's summary
    carries); now the trainer log's ends say them, as `runs` says them of the same run. On CPUs:
    tokens/s per rank, MFU null."""
    told = tmp_path / "told.json"
    job = quickstart_copy(tmp_path, tiny_model, max_steps=12, logging_steps=2)
    spec = yaml.safe_load(job.read_text())
    spec["notify"] = {"command": f"cat > {told}"}
    job.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", "--detach", str(job)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deadline = time.monotonic() + 400
    while not told.exists() and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(1)  # (the command's write, whole)
    summary = json.loads(told.read_text())
    assert summary["state"] == "finished" and summary["hosts"] == ["localhost"], summary
    logged = [json.loads(line) for line in (job.parent / ".shared/output/quickstart-lora/trainer_log.jsonl")
              .read_text().splitlines()]
    assert summary["final_loss"] == [r["loss"] for r in logged if "loss" in r][-1], summary
    assert summary["tokens_per_s"] > 0 and summary["tokens_per_s_per_rank"] == round(summary["tokens_per_s"] / 2, 1)
    assert summary["mfu"] is None, summary
    rows = json.loads(subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"],
                                     capture_output=True, text=True, timeout=120).stdout)
    assert {k: rows[-1][k] for k in ("final_loss", "tokens_per_s", "tokens_per_s_per_rank", "mfu")} == \
        {k: summary[k] for k in ("final_loss", "tokens_per_s", "tokens_per_s_per_rank", "mfu")}, (rows[-1], summary)
    # ... and its duration, which `runs` could not say of a run no launcher saw end (ended.a1)
    assert rows[-1]["duration_s"] == summary["duration_s"] and summary["duration_s"] > 0, (rows[-1], summary)

    # `status` of the same run (no live line anywhere): where training is, from the trainer log's last records
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job)], capture_output=True, text=True,
                            timeout=120)
    last = [r for r in logged if "loss" in r][-1]
    line = next((x for x in status.stdout.splitlines() if x.startswith("training: ")), status.stdout)
    assert line.startswith("training: step 12/12  epoch ") and f"  loss {last['loss']:.4f}  " in line, line
    assert re.search(r"  [\d,]+ tokens/s \([\d,]+ per rank, padding (not )?counted\)  trainer's clock ", line), line
    assert re.search(r"\(its last record \d+ s ago\)$", line), line
    # a trainer log last written well before the run began is an earlier run's (a fresh trainer
    # removes it as it begins): said so, not shown as this run's progress
    log = job.parent / ".shared/output/quickstart-lora/trainer_log.jsonl"
    plan = next((job.parent / ".shared/runs").iterdir()) / "plan.json"
    os.utime(log, (plan.stat().st_mtime - 7200, plan.stat().st_mtime - 7200))
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job)], capture_output=True, text=True,
                            timeout=120)
    assert "training: no step logged by this run yet (" in status.stdout and "before it began: an earlier run's)" \
        in status.stdout and "pace:" not in status.stdout, status.stdout
    # `status` of this run once a later run of the job writes the same output_dir (its plan.json names
    # it; a copy of this one's, as a relaunch writes it): the trainer log and checkpoints there are
    # that run's, not said as this one's (`runs` and `plot` read only the newest writer already)
    run_dir = plan.parent
    later = run_dir.parent / (run_dir.name.rsplit("-", 3)[0] + "-29991231-235959-ffff")
    later.mkdir()
    (later / "plan.json").write_text(plan.read_text())
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job), "--run", run_dir.name],
                            capture_output=True, text=True, timeout=120)
    assert f"training: not read: a later run of this job, {later.name}, writes the same output_dir " in \
        status.stdout and "checkpoint:" not in status.stdout and "pace:" not in status.stdout, status.stdout
    # another output_dir in the later plan: this run's own again
    (later / "plan.json").write_text(plan.read_text().replace('"checkpoint_dir": "', '"checkpoint_dir": "/elsewhere'))
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job), "--run", run_dir.name],
                            capture_output=True, text=True, timeout=120)
    assert "training: no step logged by this run yet (" in status.stdout and "a later run" not in status.stdout, \
        status.stdout
