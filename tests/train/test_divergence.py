"""A run whose model collapsed or whose loss went nan is stopped at the logged step it is seen,
not trained on to its end (shims/steptimes.py LossWatch; `divergence:` in the job). Real parts:
LlamaFactory on localhost with the learning rate a user typed as 1e4 for 1e-4 (Adam drives the
tiny Llama to predict every token alike: loss ln 512, gradient norm 0, as every step of the rest
of the run would say), and a real HF Trainer whose model holds a nan weight (the trainer's
logging_nan_inf_filter logs the nan loss as 0.0 beside a nan gradient norm). The rules' silence
on healthy records: tests/unit/test_divergence_unit.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import helpers
from tests.train.test_quickstart import quickstart_copy

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return helpers.tiny_model()


def run_job(job: Path, **keys) -> subprocess.CompletedProcess:
    data = yaml.safe_load(job.read_text())
    data.update(keys)
    job.write_text(yaml.safe_dump(data))
    return subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], capture_output=True, text=True,
                          timeout=600)


def test_a_collapsed_lora_is_stopped_at_the_step_it_is_seen_and_not_restarted(tmp_path, tiny_model):
    job = quickstart_copy(tmp_path, tiny_model, learning_rate=1.0e4)  # (meant: 1.0e-4)
    proc = run_job(job, restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    run = next((job.parent / ".shared/runs").iterdir())
    record = json.loads((run / "diverged.a1").read_text())
    assert record["kind"] == "flat" and record["action"] == "stop"
    assert 3 <= record["step"] < 60 and record["step"] - record["since"] == 2, record  # (of 60: stopped early)
    said = record["said"]
    assert said.startswith(f"training stopped learning at step {record['step']}: in 3 logged steps in a row since ")
    assert "= ln 512, the same odds for every token of its vocabulary" in said
    # the failure says what the ranks said (not the trainer's traceback), and the restart is not made
    assert f"its ranks stopped the run (divergence: stop, every rank at the same logged step): {said}" in out
    assert "Traceback" not in proc.stdout and "its own traceback" not in out
    assert f"not restarting: the ranks stopped the run: {said}; a restart would" in out
    assert not list(run.glob("node-0*.a2.*")) and (run / "attempt").read_text().strip() == "1"
    # nothing of it was saved as the run's result
    assert not (job.parent / ".shared/output/quickstart-lora/adapter_model.safetensors").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "failed" and summary["exit_code"] == 1 and summary["steps"] <= record["step"]
    # summary.json, `runs --json` (and a `notify:` POST, which is summary.json) say why, not "exit 1"
    assert summary["failure"] == {"host": "localhost", "node_rank": 0, "code": 1,
                                  "line": f"its ranks stopped the run: {said}"}, summary
    runs = subprocess.run([sys.executable, "-m", "ftbundle", "runs", "--json", str(job)], capture_output=True,
                          text=True, timeout=60)
    [row] = json.loads(runs.stdout)
    assert (row["state"], row["failure"]) == ("failed", f"its ranks stopped the run: {said}"), runs.stdout
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job)], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 1 and f"diverged: {said}: its ranks stopped the run\n" in status.stdout, status.stdout


def test_divergence_warn_names_it_once_and_lets_the_run_finish(tmp_path, tiny_model):
    job = quickstart_copy(tmp_path, tiny_model, learning_rate=1.0e4, max_steps=12)
    proc = run_job(job, divergence="warn")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    warned = [line for line in out.splitlines() if "warning: training stopped learning at step" in line]
    assert len(warned) == 1 and warned[0].endswith("(divergence: warn: the run goes on)"), warned
    run = next((job.parent / ".shared/runs").iterdir())
    record = json.loads((run / "diverged.a1").read_text())
    assert record["action"] == "warn"
    # the closing summary and summary.json say it again: the adapter it wrote is not to be trusted
    assert f"  diverged     {record['said']} (divergence: warn: the run went on)" in proc.stderr, proc.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["diverged"] == record["said"]
    assert (job.parent / ".shared/output/quickstart-lora/adapter_model.safetensors").exists()
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job)], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"diverged: {record['said']} (divergence: warn: the run went on)\n" in status.stdout, status.stdout


def test_a_real_trainer_whose_weights_hold_a_nan_is_stopped_on_the_third_logged_step(tmp_path, tiny_model,
                                                                                      monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from ftbundle.shims.steptimes import StepTimes, TrainingDiverged

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # (a checkpoint corrupted, or an overflow's leftover)
    rows = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones(16, dtype=torch.long)}
            for ids in torch.randint(4, 512, (32, 16), generator=torch.Generator().manual_seed(0))]
    logged: list[dict] = []

    class Seen(__import__("transformers").TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=20, logging_steps=1, use_cpu=True,
                             per_device_train_batch_size=2, report_to="none", save_strategy="no",
                             disable_tqdm=True)
    monkeypatch.setenv("FTB_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("FTB_DIVERGED_FILE", str(tmp_path / "diverged.a1"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("FTB_DIVERGENCE", raising=False)
    monkeypatch.delenv("FTB_STEPS_FILE", raising=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Seen(), StepTimes()])
    with pytest.raises(TrainingDiverged) as info:
        trainer.train()
    # what the trainer logged: the nan loss as 0.0 beside a nan gradient norm, three steps in a row
    assert [(r["loss"], str(r["grad_norm"])) for r in logged] == [(0.0, "nan")] * 3, logged
    said = str(info.value)
    assert said.startswith("training diverged at step 3: in 3 logged steps in a row since step 1 the loss is "
                           "logged as 0.0 (the trainer's stand-in for a nan loss: logging_nan_inf_filter) and "
                           "the gradient norm nan: the weights are no longer numbers"), said
    assert json.loads((tmp_path / "diverged.a1").read_text())["said"] == said
