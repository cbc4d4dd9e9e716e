"""A run whose loss went nan or whose model collapsed (shims/steptimes.py LossWatch and
``diverged``; job key ``divergence``; the failure's words in ui/summary.py). The judge is pure:
here every rule, and that it stays silent on the records a healthy run logs (an fp16 scaler's
overflowing steps, a ZeRO stage that logs no gradient norm, a noisy loss, evaluations). The
real runs (LlamaFactory on localhost, a real HF Trainer on a model with a nan weight) are in
tests/train/test_divergence.py."""

from __future__ import annotations

import io
import json
import math
import random

import pytest

from ftbundle.errors import UserError
from ftbundle.job import load_job
from ftbundle.shims.steptimes import DIVERGED_RECORDS, SKIPPED_RECORDS, LossWatch, TrainingDiverged, diverged
from ftbundle.ui.summary import RankError, failure_summary, raised_verdict

NAN, INF = float("nan"), float("inf")


def feed(records, vocab=None) -> list[tuple[int, str]]:
    """(step, what was said) for every record the watch spoke on."""
    watch, said = LossWatch(), []
    for step, logs in enumerate(records, 1):
        if (text := watch.feed(step, logs, vocab)) is not None:
            said.append((step, text))
    return said


def test_a_collapsed_model_is_named_on_its_third_flat_record_with_where_it_began():
    """The records of the real lr-1e4 run (tests/train: the tiny Llama, vocabulary 512): the loss
    settles at ln 512 with a gradient norm of 0 from step 3 on."""
    records = [{"loss": 6.2556, "grad_norm": 0.2333, "learning_rate": 1e4},
               {"loss": 6.2828, "grad_norm": 74.97, "learning_rate": 9830.0}] + \
              [{"loss": 6.238325 + d, "grad_norm": 0.0, "learning_rate": 9330.0} for d in (0, -1e-6, 1e-6, 0)]
    said = feed(records, vocab=512)
    assert [step for step, _ in said] == [5]  # (steps 3, 4, 5 flat; once only)
    assert said[0][1] == (
        "training stopped learning at step 5: in 3 logged steps in a row since step 3 the gradient norm is 0 and the "
        "loss stays at 6.2383 = ln 512, the same odds for every token of its vocabulary: no batch moves the weights "
        "(the model collapsed) (learning rate 9.33e+03)")
    # without the vocabulary (a script's model with no config): the same verdict, no ln
    assert "ln" not in feed(records)[0][1]


@pytest.mark.parametrize("loss, grad, shown", [
    (NAN, NAN, "the loss is nan and the gradient norm nan"),
    (INF, None, "the loss is inf:"),
    # the HF Trainer's logging_nan_inf_filter: a window of nan losses is logged as 0.0
    (0.0, NAN, "the loss is logged as 0.0 (the trainer's stand-in for a nan loss: logging_nan_inf_filter) and the "
               "gradient norm nan"),
    ("0", "nan", "the loss is logged as 0.0"),  # (transformers 5 may hand strings on)
])
def test_a_nan_run_is_named_diverged_after_three_records(loss, grad, shown):
    healthy = [{"loss": 1.46, "grad_norm": 0.9}, {"loss": 1.44, "grad_norm": 1.1}]
    bad = {"loss": loss, **({"grad_norm": grad} if grad is not None else {}), "learning_rate": 2e-4}
    said = feed(healthy + [bad] * 5)
    assert [step for step, _ in said] == [5]
    assert said[0][1].startswith("training diverged at step 5: in 3 logged steps in a row since step 3 ")
    assert shown in said[0][1]
    assert said[0][1].endswith("(learning rate 0.0002); its last good checkpoint is one saved at or before step 2 "
                               "(the last step logged before it)")
    # nan from the first record on: no checkpoint of it is named good
    assert said and "checkpoint" not in feed([bad] * 3)[0][1]


def test_an_fp16_run_whose_every_step_overflows_is_named_after_fifty_records_not_at_its_start():
    """LlamaFactory issue 5660: fp16, `'loss': 4.6758, 'grad_norm': nan` at every step: the scaler
    skips each one and the weights never move. A healthy fp16 start overflows a dozen times."""
    start = [{"loss": 4.6 + (i % 3) / 10, "grad_norm": NAN if i % 2 else INF} for i in range(SKIPPED_RECORDS - 1)]
    assert feed(start + [{"loss": 4.5, "grad_norm": 2.0}] * 10) == []
    said = feed(start + [{"loss": 4.5003, "grad_norm": NAN, "learning_rate": 1e-4}] * 3)
    assert [step for step, _ in said] == [SKIPPED_RECORDS]
    assert said[0][1] == (
        "training skips every step at step 50: in 50 logged steps in a row since step 1 the gradient norm is nan "
        "beside a loss of 4.5003: each step's gradients overflow, an fp16 loss scaler skips the step and lowers "
        "its scale, and no step since has moved the weights (learning rate 0.0001); bf16, or a lower learning rate")


def test_what_a_healthy_run_logs_is_never_named():
    rng = random.Random(7)
    noisy = [{"loss": 2.0 * math.exp(-i / 300) + rng.uniform(-0.3, 0.3), "grad_norm": rng.uniform(0.2, 3)}
             for i in range(2000)]
    assert feed(noisy, vocab=32000) == []
    # fp16: the loss scaler's overflowing steps log an inf or nan gradient norm beside a finite
    # loss (the step skipped, the scale lowered), a dozen in a row at the start: not nan weights
    overflow = [{"loss": 2.31 + i / 100, "grad_norm": g} for i, g in enumerate([INF, NAN] * 8)]
    assert feed(overflow + noisy[:50]) == []
    # a ZeRO stage that logs its gradient norm as 0 while the loss moves: not a collapse
    zero = [{"loss": r["loss"], "grad_norm": 0.0} for r in noisy[:100]]
    assert feed(zero) == []
    # an exactly 0 loss beside a finite gradient norm (a model that fits its batches): not nan;
    # nor one with no gradient at all (a GRPO group whose completions all scored alike: nothing to
    # learn from those batches, not a collapsed model)
    assert feed([{"loss": 0.0, "grad_norm": 0.01}] * 10) == []
    assert feed([{"loss": 0.0, "grad_norm": 0.0}] * 10) == []
    # evaluations and the trainer's closing record carry no "loss": not counted, and they do
    # not break a run of bad records either way
    evals = [{"eval_loss": NAN}, {"train_loss": NAN, "train_runtime": 3.0}] * 5
    assert feed(evals) == []


def test_a_good_record_between_bad_ones_starts_the_count_again():
    nan, good = {"loss": NAN}, {"loss": 1.2, "grad_norm": 0.5}
    assert feed([nan, nan, good, nan, nan, good] * 3) == []
    assert [step for step, _ in feed([nan, nan, good, nan, nan, nan])] == [6]
    # a flat run interrupted by a record whose loss moves: counted again from there
    flat = {"loss": 6.2383, "grad_norm": 0.0}
    assert feed([flat, flat, {"loss": 6.1, "grad_norm": 0.0}, flat, flat]) == []
    assert DIVERGED_RECORDS == 3


def test_the_verdict_is_kept_in_the_run_directory_by_rank_0_then_every_rank_stops(tmp_path, monkeypatch, capsys):
    watch = LossWatch()
    for step in (1, 2, 3):
        said = watch.feed(step, {"loss": NAN})
    monkeypatch.setenv("FTB_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("FTB_DIVERGED_FILE", str(tmp_path / "diverged.a2"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("FTB_DIVERGENCE", raising=False)  # (inside a run: stop by default)
    with pytest.raises(TrainingDiverged, match="^training diverged at step 3"):
        diverged(said, 3, watch)
    record = json.loads((tmp_path / "diverged.a2").read_text())
    assert record == {"step": 3, "since": 1, "kind": "nan", "action": "stop", "said": said}
    assert capsys.readouterr().err == f"ftbundle: {said}: stopping the run (divergence: stop)\n"
    # another rank: raises the same, writes nothing, says nothing (rank 0 says it once)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("FTB_DIVERGED_FILE", str(tmp_path / "diverged.a3"))
    with pytest.raises(TrainingDiverged):
        diverged(said, 3, watch)
    assert not (tmp_path / "diverged.a3").exists() and capsys.readouterr().err == ""
    # warn: kept, said once on rank 0's stderr (the launcher's warnings show it), no raise
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("FTB_DIVERGENCE", "warn")
    diverged(said, 3, watch)
    assert json.loads((tmp_path / "diverged.a3").read_text())["action"] == "warn"
    assert capsys.readouterr().err == f"ftbundle: warning: {said} (divergence: warn: the run goes on)\n"
    # outside ftbundle (no run directory): a warning, nothing written
    monkeypatch.delenv("FTB_RUN_DIR")
    monkeypatch.delenv("FTB_DIVERGED_FILE")
    monkeypatch.delenv("FTB_DIVERGENCE")
    diverged(said, 3, watch)
    assert "warning" in capsys.readouterr().err


def test_the_failure_summary_says_what_the_ranks_said_not_the_trainers_traceback():
    said = "training diverged at step 3: in 3 logged steps in a row since step 1 the loss is nan"
    error = RankError(local_rank=0, rank=0, message=f"TrainingDiverged: {said}",
                      traceback="Traceback (most recent call last):\n  File \"trainer.py\", line 1\n"
                                f"ftb_steptimes.TrainingDiverged: {said}", timestamp=1)
    assert raised_verdict(error, None) == said
    assert raised_verdict(None, f"Traceback ...\nftb_steptimes.TrainingDiverged: {said}\n") == said
    assert raised_verdict(RankError(0, 0, "ValueError: x", "Traceback\nValueError: x", 1), None) is None
    lines = failure_summary(host="node1", address="10.0.0.2", node_rank=1, reason="exited with code 1", code=1,
                            rank_error=error, rank_traceback=None, tail=["x"], log_path="/shared/runs/r/node-1.log",
                            local_rank=0, global_rank=4)
    assert lines == ["failed: host node1 (10.0.0.2), node rank 1, rank 4, local rank 0; exit code 1",
                     "its ranks stopped the run (divergence: stop, every rank at the same logged step): " + said,
                     "full log: /shared/runs/r/node-1.log"]


def test_the_job_key_is_stop_or_warn_and_reaches_every_rank(tmp_path):
    from ftbundle.inventory import Host
    from tests.support.helpers import plan_of

    hosts = [Host("a", "10.0.0.1"), Host("b", "10.0.0.2")]
    path = tmp_path / "job.yaml"
    path.write_text("name: j\nshared_dir: /shared\ntrain:\n  command: 'true'\n")
    assert load_job(path).divergence == "stop"
    assert [n.env["FTB_DIVERGENCE"] for n in plan_of(load_job(path), hosts).nodes] == ["stop", "stop"]
    path.write_text("name: j\nshared_dir: /shared\ndivergence: warn\ntrain:\n  command: 'true'\n")
    assert [n.env["FTB_DIVERGENCE"] for n in plan_of(load_job(path), hosts).nodes] == ["warn", "warn"]
    path.write_text("name: j\ndivergence: stpo\ntrain:\n  command: 'true'\n")
    with pytest.raises(UserError) as info:
        load_job(path)
    assert info.value.key == "divergence" and str(path) in str(info.value)
    assert "must be one of stop, warn" in str(info.value) and "did you mean 'stop'" in str(info.value)


def test_the_ranks_get_where_to_keep_the_verdict_on_the_host_and_in_a_container():
    """FTB_DIVERGED_FILE is the node program's (rundir.env: the attempt's own diverged.aN), which a
    host job inherits; a container gets it by name, as it gets FTB_STEPS_FILE."""
    from ftbundle import rundir
    from ftbundle.runtimes import docker_prefix

    run = rundir.RunDir.of("/shared", "j-20261203-120000-abcd")
    assert run.env(2)["FTB_DIVERGED_FILE"] == "/shared/runs/j-20261203-120000-abcd/diverged.a2"
    argv = docker_prefix(image="img@sha256:x", name="c", shared_dir="/shared", workdir="/shared", env_names=[],
                         env_file=None, gpus=None)
    assert "FTB_DIVERGED_FILE" in [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]


def test_a_scripts_own_loop_passes_its_loss_to_the_step_clock_and_is_judged_alike(tmp_path, monkeypatch):
    from ftbundle.shims.steptimes import StepClock

    monkeypatch.setenv("FTB_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("FTB_DIVERGED_FILE", str(tmp_path / "diverged.a1"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("FTB_DIVERGENCE", raising=False)
    clock = StepClock(None)
    for loss in (2.1, 2.0, 1.9, 1.95) * 50:  # (healthy: nothing said, no step without a loss judged)
        clock.step_done(tokens=100, loss=loss, grad_norm=1.0)
    clock.step_done()
    clock.step_done(loss=NAN, grad_norm=NAN)
    clock.step_done(loss=NAN)
    with pytest.raises(TrainingDiverged, match="^training diverged at step 204: in 3 logged steps in a row since "
                                               "step 202 the loss is nan"):
        clock.step_done(loss=NAN)
    assert json.loads((tmp_path / "diverged.a1").read_text())["step"] == 204


def test_status_says_the_verdict_once():
    from ftbundle.history import diverged_lines

    said = "training diverged at step 30: in 3 logged steps in a row since step 28 the loss is nan"
    stop, warn = json.dumps({"action": "stop", "said": said}), json.dumps({"action": "warn", "said": said})
    assert diverged_lines(warn, {}) == [f"diverged: {said} (divergence: warn: the run went on)"]
    assert diverged_lines(stop, {}) == [f"diverged: {said}: its ranks stopped the run"]
    # a detached run's end record says it already (its `ended:` line): not twice
    told = {"state": "failed", "failure": {"host": "gpu-a", "line": f"its ranks stopped the run: {said}"}}
    assert diverged_lines(stop, told) == []
    assert diverged_lines(None, {}) == diverged_lines("{\"action\": \"st", {}) == diverged_lines("[]", {}) == []


def test_a_warned_runs_word_is_kept_for_its_summary_from_rank_0s_line():
    from ftbundle.launch.display import ProgressFeed
    from ftbundle.ui.phases import Phases
    from ftbundle.ui.progress import Progress

    said = "training stopped learning at step 5: in 3 logged steps in a row since step 3 the gradient norm is 0"
    line = f"ftbundle: warning: {said} (divergence: warn: the run goes on)"  # (as diverged() prints it)
    # through the display's feed as a read block (a warning: fed line by line, kept)
    p = Progress()
    feed = ProgressFeed(Phases(io.StringIO(), tty=False), p, on_change=lambda: None)
    feed.lines("[node0 r0] ", ["other", line, "more"])
    assert p.diverged == said
    p = Progress()
    assert p.feed_line(line) is True and p.diverged == said
    p.feed_line(line.replace("step 5", "step 9"))  # (said once: the first word stays)
    assert p.diverged == said
