"""remote/tell.py, rank 0's word when an attached run's launcher is lost: once, not when the
launcher wrote summary.json, the trainer log's figures where the log is this run's. The shipped
text (launch/stall.py TELL_PARTS) is whole Python. On real hosts: tests/cluster/test_notify.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ftbundle.launch.stall import teller_source
from ftbundle.remote import tell as T


def env_of(tmp_path, **extra) -> dict:
    run = tmp_path / "runs" / "job-20261204-000000-abcd"
    run.mkdir(parents=True)
    (run / "plan.json").write_text("{}")
    return {"FTB_RUN_DIR": str(run), "FTB_ENDED_FILE": str(run / "ended.a1"), "FTB_RUN_ID": run.name,
            "FTB_SUMMARY_FILE": str(run / "summary.json"), "FTB_PLAN_FILE": str(run / "plan.json"),
            "FTB_NODE_HOSTS": "node0 node1", "NNODES": "2", "FTB_LOG": str(run / "node-0-node0.a1.log"), **extra}


def test_the_end_is_written_once_with_the_trainer_logs_figures(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in (
        {"current_steps": 1, "loss": 2.5, "total_tokens": 1000, "elapsed_time": "0:00:01"},
        {"current_steps": 9, "loss": 1.25, "total_tokens": 9000, "elapsed_time": "0:00:09", "throughput": 1000.0})))
    env = env_of(tmp_path, FTB_TRAINER_LOG=str(log), FTB_SPEED="2 1e-06")
    assert T.tell(env, "launcher lost: the launcher's connection closed", 42.04, grace_s=0, now=lambda: 1000.0)
    ended = json.loads(open(env["FTB_ENDED_FILE"]).read())
    assert ended["state"] == "stopped: launcher lost" and ended["duration_s"] == 42.0 and ended["started"] == 957.96
    assert ended["failure"]["line"] == "launcher lost: the launcher's connection closed" and ended["exit_code"] is None
    assert (ended["hosts"], ended["final_loss"], ended["tokens_per_s"]) == (["node0", "node1"], 1.25, 1000.0)
    assert (ended["tokens_per_s_per_rank"], ended["mfu"]) == (500.0, 0.001) and ended["detached"] is False
    # a second teller (or the same, started twice) says nothing: the first claimed ended.a1
    assert not T.tell(env, "launcher lost: x", 50, grace_s=0)
    assert json.loads(open(env["FTB_ENDED_FILE"]).read()) == ended


def test_nothing_is_said_where_the_launcher_lived_and_an_earlier_runs_log_is_not_read(tmp_path):
    env = env_of(tmp_path)
    with open(os.path.join(env["FTB_RUN_DIR"], "summary.json"), "w") as f:
        f.write('{"state": "failed"}')
    assert not T.tell(env, "launcher lost: x", 5, grace_s=0) and not os.path.exists(env["FTB_ENDED_FILE"])
    old = tmp_path / "old" / "trainer_log.jsonl"
    old.parent.mkdir()
    old.write_text(json.dumps({"loss": 9.0, "total_tokens": 5, "elapsed_time": "0:00:01"}) + "\n")
    os.utime(old, (1, 1))  # (written long before this run's plan.json)
    again = env_of(tmp_path / "b", FTB_TRAINER_LOG=str(old))
    assert T.tell(again, "launcher lost: x", 5, grace_s=0)
    assert json.loads(open(again["FTB_ENDED_FILE"]).read())["final_loss"] is None


def test_the_shipped_text_runs_alone_and_ignores_a_stop_its_launcher_asked_for(tmp_path):
    program = tmp_path / "tell.py"
    program.write_text(teller_source())
    env = env_of(tmp_path, FTB_STOPPED_FILE=str(tmp_path / "node-0.a1.stopped"))
    # no stopped file (the launcher's own stop): it ends at once, writes nothing
    done = subprocess.run([sys.executable, "-I", "-S", str(program), "3"], env=env, capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 0 and not done.stderr and not os.path.exists(env["FTB_ENDED_FILE"]), done.stderr
    (tmp_path / "node-0.a1.stopped").write_text("storage: not answering\n")  # (not the launcher: nothing)
    done = subprocess.run([sys.executable, "-I", "-S", str(program), "3"], env=env, capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 0 and not os.path.exists(env["FTB_ENDED_FILE"]), done.stderr
