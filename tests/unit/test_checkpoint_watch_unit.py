"""The first real checkpoint against the room left (issue 46 item 4, in the run): how many more
the run writes, and the line said once its size is read (pure). Read for real on containerized
hosts: tests/cluster/test_node_loss.py (checkpoint-5 of a LoRA, save_total_limit 3)."""

from __future__ import annotations

from types import SimpleNamespace

from ftbundle.launch.checkpoints import CheckpointWatch, needs, verdict


def test_how_many_more_the_run_writes():
    assert needs(5, 5, 30, None) == 5  # 10, 15, 20, 25, 30
    assert needs(5, 5, 30, 3) == 3  # at most save_total_limit at once (the new one before the oldest goes)
    assert needs(30, 5, 30, 3) == 0
    assert needs(500, 500, None, 2) == 2 and needs(500, 500, None, None) is None  # (no step count: the limit)


def test_the_line_names_the_size_the_room_and_warns_when_too_few_fit():
    line, warn = verdict("checkpoint-5", 1_200_000_000, 14_600_000_000, "node0", 3, 3)
    assert (line, warn) == ("checkpoint-5 holds 1.2 GB; 12 more fit in the 14.6 GB free where output_dir is (on "
                            "node0); the run writes 3 more (save_total_limit 3)", False)
    line, warn = verdict("checkpoint-100", 40_000_000_000, 90_000_000_000, "gpu-000", 5, None)
    assert warn and line.startswith("checkpoint-100 holds 40.0 GB; 2 more fit in the 90.0 GB free where output_dir "
                                    "is (on gpu-000); the run writes 5 more: the disk fills before the run ends")
    assert verdict("checkpoint-5", 10, 95, "h", 9, None)[1] is False  # 9 fit, 9 needed
    assert verdict("checkpoint-5", 10, 89, "h", 9, None)[1] is True
    assert verdict("checkpoint-5", 10, 89, "h", None, None) == ("checkpoint-5 holds 10 B; 8 more fit in the 89 B "
                                                                "free where output_dir is (on h)", False)


def test_the_first_save_of_this_attempt_and_who_is_watched():
    plan = SimpleNamespace(checkpoint_dir="/s/out", nodes=[])
    assert CheckpointWatch(plan, None, {"save_steps": 5}).first == 5
    assert CheckpointWatch(plan, None, {"save_steps": 5}, start_step=12).first == 15  # resumed at 12
    assert CheckpointWatch(plan, None, {}).first == 500  # the Trainer's default save_steps
    assert not CheckpointWatch(plan, None, {"save_strategy": "epoch"}).enabled
    assert not CheckpointWatch(plan, None, None).enabled  # not LlamaFactory (a burn-in's plan, a script)
    assert not CheckpointWatch(SimpleNamespace(checkpoint_dir=None, nodes=[]), None, {"save_steps": 5}).enabled
    watch = CheckpointWatch(plan, None, {"save_steps": 5})
    watch.tick(5, 30)  # the save at 5 may still be written: nothing read yet
    assert not watch._started and watch.said() is None


def test_the_staging_time_is_the_first_part_of_the_start_up():
    from ftbundle.ui.progress import Progress, startup_text

    p = Progress(before=(("staging data", 22.7),))
    p.started = 100.0
    p.stages = [("loading model", 104.0)]
    p.first_step_at = 110.0
    assert p.startup() == [("staging data", 22.7), ("launch and start-up", 4.0), ("loading model", 6.0)]
    assert startup_text(p.startup()) == "32.7 s: staging data 22.7 s, launch and start-up 4.0 s, loading model 6.0 s"
    assert Progress(before=(("staging data", 1.0),)).startup() == []  # (nothing seen yet: nothing said)


def test_status_says_the_newest_checkpoint_and_what_a_failure_now_costs():
    """`ftbundle status`'s checkpoint line (launch/resume.py checkpoint_status, pure; read for real in
    tests/cluster/test_resume.py and tests/cluster/test_pace.py): at 2 a.m. on day 5, how much
    training does a failure now throw away?"""
    from ftbundle.launch.resume import checkpoint_status
    from ftbundle.ui.pace import last_step

    out = "/shared/out"
    assert checkpoint_status(out, "checkpoint-12000", 6125, 12340, running=True, resumes=True) == (
        "checkpoint: checkpoint-12000 in /shared/out, written 1:42:05 ago; the trainer is at step 12340; "
        "a failure now resumes from step 12000 (340 steps trained again)")
    assert checkpoint_status(out, "checkpoint-12000", 30, 12000, running=True, resumes=True).endswith(
        "a failure now resumes from step 12000")  # (just saved: nothing lost)
    assert checkpoint_status(out, None, None, 340, running=True, resumes=True) == (
        "checkpoint: none yet in /shared/out; the trainer is at step 340; a failure now starts again from step 0")
    assert checkpoint_status(out, "checkpoint-500", 3 * 86400 + 5, 900, running=True, resumes=False) == (
        "checkpoint: checkpoint-500 in /shared/out, written 3d 00:00:05 ago; the trainer is at step 900; a restart "
        "does not resume from it (the config sets overwrite_output_dir or resume_from_checkpoint)")
    # a run that is over, or whose plan.json predates the key: the facts alone
    assert checkpoint_status(out, "checkpoint-20", 65, 20, running=False, resumes=True) == (
        "checkpoint: checkpoint-20 in /shared/out, written 01:05 ago; the trainer is at step 20")
    assert checkpoint_status(out, "checkpoint-20", None, None, running=True, resumes=None) == (
        "checkpoint: checkpoint-20 in /shared/out")
    log = '{"current_steps": 9, "loss": 1.0}\n{"current_steps": 10, "loss": 0.9}\n{"current_st'  # (a line being written)
    assert last_step(log) == 10 and last_step("") is None and last_step("not json\n") is None
