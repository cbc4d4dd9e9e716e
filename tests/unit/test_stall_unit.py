"""The stall watchdog's pure parts: the job key, the clock, the diagnosis, the NCCL env."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ftbundle.errors import UserError
from ftbundle.facts import ClusterFacts, Gpu, HostFacts
from ftbundle.inventory import Host
from ftbundle.job import load_job
from ftbundle.launch.node import Event, NodeRunner, node_env
from ftbundle.launch.stall import RankStack, StallClock, diagnose, place, report_lines
from ftbundle.rundir import NodeFiles
from tests.support.helpers import REPO, plan_of

JOB = "name: j\nshared_dir: /shared\ntrain:\n  script: train.py\n"
HOSTS = [Host("n1", "10.0.0.1"), Host("n2", "10.0.0.2")]


def job(tmp_path: Path, extra: str = ""):
    path = tmp_path / "job.yaml"
    path.write_text(JOB + extra)
    return load_job(path)


def test_stall_timeout_defaults_to_600_and_0_turns_it_off(tmp_path):
    assert job(tmp_path).stall_timeout == 600
    assert job(tmp_path, "stall_timeout: 0\n").stall_timeout == 0
    plan = plan_of(job(tmp_path, "stall_timeout: 30\n"), HOSTS)
    assert plan.stall_timeout == 30 and plan.to_dict()["stall_timeout"] == 30


@pytest.mark.parametrize("value,fragment", [("ten", "must be an integer"), ("-1", "between 0 and"),
                                            ("2", "at least 5 seconds"), ("1.5", "must be an integer")])
def test_bad_stall_timeout_names_file_and_key(tmp_path, value, fragment):
    with pytest.raises(UserError) as info:
        job(tmp_path, f"stall_timeout: {value}\n")
    assert info.value.key == "stall_timeout" and str(tmp_path / "job.yaml") in str(info.value)
    assert fragment in str(info.value)


def test_bad_stall_timeout_exits_2_and_starts_nothing(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB + "stall_timeout: soon\n")
    p = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(path)], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert p.returncode == 2
    assert "stall_timeout" in p.stderr and str(path) in p.stderr
    assert not (tmp_path / ".ftbundle").exists() and not Path("/shared/runs").exists()


def test_clock_starts_at_the_first_progress_and_every_new_byte_resets_it():
    clock = StallClock(10)
    clock.observe(0, "500", at=0)  # an earlier attempt's output: the baseline, not progress
    clock.observe(1, "0", at=0)
    assert not clock.stalled(now=100)  # loading a model for 100 s is not a stall
    clock.observe(1, "120", at=100)  # the first output
    assert not clock.stalled(now=110) and clock.stalled(now=110.5)
    clock.observe(0, "540", at=108)  # any rank's new output resets it
    assert not clock.stalled(now=118) and clock.stalled(now=118.5)
    clock.observe(0, "540", at=118)  # the same size: no progress
    assert clock.stalled(now=119)
    off = StallClock(0)
    off.observe(0, "1", 0)
    off.observe(0, "2", 1)
    assert not off.stalled(now=10_000)


def test_heartbeat_carries_the_progress_and_node_env_names_what_counts(tmp_path):
    plan = plan_of(job(tmp_path, "stall_timeout: 30\n"), HOSTS)
    import queue

    events: queue.Queue[Event] = queue.Queue()
    runner = NodeRunner(plan.nodes[1], plan, None, events)
    runner._on_line(b"ftb-hb 4096")
    runner._on_line(b"ftb-hb")
    assert [(e.kind, e.text) for e in (events.get(), events.get())] == [("hb", "4096"), ("hb", "")]
    files = NodeFiles.of(plan.run_dir, plan.run_id, 1, "n2", 1)
    env = node_env(plan.nodes[1], plan, files, 1, detach=False)
    assert env["FTB_PROGRESS_FILES"].split() == [
        f"{plan.run_dir}/node-1-n2.a*.log", f"{plan.run_dir}/ranks/node-1/*/*/*/*.log"]
    off = plan_of(job(tmp_path, "stall_timeout: 0\n"), HOSTS)
    assert node_env(off.nodes[1], off, files, 1, detach=False)["FTB_PROGRESS_FILES"] == ""


def _rank(rank, frames, state="S", node=None, cpu=0.0):
    return RankStack(host=f"n{rank // 2 + 1}", node_rank=rank // 2 if node is None else node, rank=rank,
                     local_rank=rank % 2, pid=100 + rank, state=state, cpu_s=cpu, sample_s=2.0,
                     frames=[{"name": n, "filename": f, "line": l} for n, f, l in frames])


ALLREDUCE = [("all_reduce", "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2501),
             ("wrapper", "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81),
             ("<module>", "/shared/train.py", 24)]
STUCK = [("wait_for_lock", "/shared/train.py", 16), ("<module>", "/shared/train.py", 22)]


def test_ranks_grouped_by_place_and_the_odd_one_named_with_its_stack():
    ranks = [_rank(0, ALLREDUCE), _rank(1, ALLREDUCE), _rank(2, ALLREDUCE), _rank(3, STUCK, state="R", cpu=2.0)]
    d = diagnose(ranks)
    assert [(k, len(m)) for k, m in d.groups] == [("all_reduce at train.py:24", 3), ("wait_for_lock at train.py:16", 1)]
    assert d.odd == [ranks[3]]
    text = "\n".join(report_lines(d, out_dir="/shared/runs/r1/stacks/a1-stall", expected=4))
    assert "3 ranks in all_reduce at train.py:24  (ranks 0, 1, 2; 0.00 s CPU each in 2 s)" in text
    assert ("the odd one out: rank 3 on n2 (node 1, local 1, pid 103): wait_for_lock at train.py:16, running, "
            "2.00 s CPU in 2 s") in text
    assert "      wait_for_lock (/shared/train.py:16)" in text
    assert text.endswith("every rank's state and full stack (all threads): /shared/runs/r1/stacks/a1-stall/")


def test_a_frozen_rank_is_named_by_its_state_even_where_its_peers_are():
    ranks = [_rank(0, ALLREDUCE), _rank(1, ALLREDUCE, state="T"), _rank(2, ALLREDUCE), _rank(3, ALLREDUCE)]
    d = diagnose(ranks)
    assert d.odd == [ranks[1]]
    assert place(ranks[1]) == "stopped (SIGSTOP) in all_reduce at train.py:24"
    d_state = diagnose([_rank(0, ALLREDUCE), _rank(1, [], state="D")])
    assert place(d_state.odd[0]) == "in D state (uninterruptible I/O)"


def test_every_rank_in_one_place_names_no_one():
    d = diagnose([_rank(r, ALLREDUCE) for r in range(4)])
    assert d.odd == []
    assert any("every rank is in the same place" in line for line in report_lines(d, out_dir="/x"))


def test_nccl_jobs_get_torch_flight_recorder_and_async_error_handling(tmp_path):
    gpu = Gpu("NVIDIA H100", "550.54", 81559, "9.0")
    facts = ClusterFacts([HostFacts("n1", 0, gpus=[gpu]), HostFacts("n2", 1, gpus=[gpu])])
    plan = plan_of(job(tmp_path), HOSTS, facts=facts)
    env = plan.nodes[1].env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # the flight recorder under the name the ranks' torch reads (the old one warns on torch >= 2.8)
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    for version, name in (("2.11.0+cu130", "TORCH_FR_BUFFER_SIZE"), ("2.7.1", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        known = ClusterFacts([HostFacts(n, r, gpus=[gpu], versions={"torch": version}) for r, n in enumerate(["n1", "n2"])])
        [flight] = [k for k in plan_of(job(tmp_path), HOSTS, facts=known).nodes[0].env if k.endswith("BUFFER_SIZE")]
        assert flight == name, version
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{plan.run_dir}/nccl-trace-rank-"
    assert env["TORCH_NCCL_DESYNC_DEBUG"] == "1"
    # the job's own env wins; a CPU job (gloo) gets none of it
    mine = plan_of(job(tmp_path, "env:\n  TORCH_NCCL_DESYNC_DEBUG: 0\n  NCCL_DEBUG: WARN\n"), HOSTS)
    assert mine.nodes[0].env["TORCH_NCCL_DESYNC_DEBUG"] == "0" and mine.nodes[0].env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    cpu = plan_of(job(tmp_path), HOSTS, facts=ClusterFacts([HostFacts("n1", 0), HostFacts("n2", 1)]))
    assert not any(k.startswith("TORCH_NCCL") for k in cpu.nodes[0].env)


def test_llamafactory_clock_waits_for_the_first_trainer_step():
    clock = StallClock(10, wait_for_step=True)
    clock.observe(0, "100 0", at=0)
    clock.observe(0, "5000 0", at=5)  # model loading's output: not yet
    assert not clock.stalled(now=500)
    clock.observe(0, "5200 180", at=600)  # trainer_log.jsonl has its first step
    assert not clock.stalled(now=610) and clock.stalled(now=611)


def test_node_program_reports_progress_and_trainer_steps(tmp_path):
    """ftb_progress, as node.sh runs it with each heartbeat: the ranks' bytes, then the
    trainer log's once it exists (0 before)."""
    from ftbundle.launch.node import program

    (tmp_path / "a.log").write_text("x" * 10)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "b.log").write_text("y" * 5)
    script = program().split("\nftb_env() {")[0] + '\nftb_progress; [ -z "$FTB_P" ] || echo "$FTB_P"\n'
    env = {"PATH": "/usr/bin:/bin", "FTB_PROGRESS_FILES": f"{tmp_path}/*.log {tmp_path}/r/*.log"}
    run = lambda **extra: subprocess.run(["bash", "-c", script], env={**env, **extra}, capture_output=True,  # noqa: E731
                                         text=True).stdout
    assert run() == " 15\n"
    assert run(FTB_PROGRESS_STEPS=str(tmp_path / "trainer_log.jsonl")) == " 15 0\n"
    (tmp_path / "trainer_log.jsonl").write_text("{}\n")
    assert run(FTB_PROGRESS_STEPS=str(tmp_path / "trainer_log.jsonl")) == " 15 3\n"
    assert run(FTB_PROGRESS_FILES="") == ""


def test_node_program_beats_without_a_process_and_reads_progress_every_nth_beat(tmp_path):
    """The real node program (mode `node`, as the controller starts it, with the env on stdin
    and pings after it): a heartbeat every FTB_HEARTBEAT seconds, the progress only on every
    FTB_PROGRESS_EVERY-th, and between readings no process is started (no `sleep`; the one child
    ever seen is a reading's own `stat`: the beat loop's children are counted in /proc)."""
    import time

    from ftbundle.launch.node import env_payload, progress_every, program

    assert [progress_every(t) for t in (5, 10, 59, 60, 300, 600, 3600, 0)] == [1, 1, 1, 2, 10, 10, 10, 10]
    (tmp_path / "rank.log").write_text("x" * 7)
    env = {"FTB_RUN_DIR": str(tmp_path), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(tmp_path / "job.log"),
           "FTB_EXIT": str(tmp_path / "node.exit"), "FTB_PIDFILE": str(tmp_path / "node.pid"),
           "FTB_HBFILE": str(tmp_path / "node.hb"), "FTB_MARKER": "ftb-test-beats", "FTB_ATTEMPT": "1",
           "FTB_WATCHDOG": "10", "FTB_HEARTBEAT": "0.2", "FTB_STOP_GRACE": "1", "FTB_DETACH": "0",
           "FTB_PROGRESS_FILES": f"{tmp_path}/*.log", "FTB_PROGRESS_EVERY": "4"}
    proc = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sleep", "4"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    proc.stdin.write(env_payload(env))
    proc.stdin.flush()
    time.sleep(1.2)
    children = [c.split() for c in subprocess.run(["ps", "-o", "pid=,sid=,comm=", "--ppid", str(proc.pid)],
                                                  capture_output=True, text=True).stdout.splitlines()]
    # the beat loop and the watchdog: subshells (the job runs in a session of its own)
    beaters = [pid for pid, sid, comm in children if comm == "bash" and pid != sid]
    seen = set()
    for _ in range(20):  # a second of the beat loop's children: none ever
        for pid in beaters:
            seen.update(subprocess.run(["ps", "-o", "comm=", "--ppid", pid], capture_output=True,
                                       text=True).stdout.split())
        time.sleep(0.05)
    code = proc.wait(timeout=20)  # (stdin stays open, as the controller's does, until the job ends)
    out = proc.stderr.read().decode().splitlines()
    proc.stdin.close()
    assert code == 0, out
    beats = [line for line in out if line.startswith("ftb-hb")]
    assert out[0].startswith("ftb-pid ") and beats[0] == "ftb-hb 7", out  # the baseline, before the job
    loop = beats[1:]
    assert len(loop) >= 16, out  # 4 s at 0.2 s
    # (read by a child the beat never waits for: asked on one beat, its answer sent on the next)
    assert all(b == ("ftb-hb 7" if i % 4 == 1 else "ftb-hb") for i, b in enumerate(loop)), loop
    assert len(beaters) >= 2 and seen <= {"stat"}, (beaters, seen)  # (a reading's own stat may be caught)
