"""A host lost for good (issue 36 item 3): `on_node_loss: exclude` on three containerized hosts x
1 CPU rank, a LlamaFactory LoRA with checkpoints every 5 steps. A host's container killed after
the first checkpoint: attempt 2 runs on the two left, resumes from that checkpoint with the
global batch kept (HF's "Total train batch size" is 12 in both attempts: accumulation 2 -> 3),
exits 0 and names the lost host. Rank 0's host only cut off (nftables), not dead, and back during
attempt 2: MASTER_ADDR moves to the next host, and the cut-off host writes nothing once the run
went on without it."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import yaml

from ftbundle.recovery import RECOVERY_PARTS

from tests.support.helpers import (REPO, base_job, ftbundle, job_processes, only_run_dir, quickstart_lora, start_ftbundle,
                           write_job)
from tests.unit.test_notify_unit import Hook

pytestmark = [pytest.mark.cluster, pytest.mark.train]

TOTAL = "Total train batch size (w. parallel, distributed & accumulation) = 12"


def with_spares(inventory, names: tuple[str, ...], host_vars: dict[str, dict] | None = None):
    """The inventory with ``names`` moved from the trainers group to a `spares` group, each
    with its ``host_vars`` (name -> vars) added."""
    inv = yaml.safe_load(inventory.read_text())
    trainers = inv["all"]["children"]["trainers"]["hosts"]
    inv["all"]["children"]["spares"] = {"hosts": {name: {**trainers.pop(name), **(host_vars or {}).get(name, {})}
                                                  for name in names}}
    inventory.write_text(yaml.safe_dump(inv, sort_keys=False))
    return inventory


LOSS_KEYS = {"restarts": 1, "on_node_loss": "exclude", "stall_timeout": 0}


def lora_job(cluster, tmp_path, name: str, steps: int = 30, spares: tuple[str, ...] = (), **keys):
    """A LlamaFactory LoRA (checkpoints every 5 steps) that goes on without a lost host: (job, output_dir)."""
    shared = cluster.shared_dir
    inventory = with_spares(cluster.write_inventory(tmp_path / "hosts.yml"), spares)
    output = shared / "output/lora"
    train = quickstart_lora(shared, max_steps=steps, save_steps=5, save_total_limit=3, per_device_train_batch_size=2,
                            gradient_accumulation_steps=2)
    job = write_job(tmp_path / "job.yaml", base_job(name, shared, inventory, {"llamafactory": train},
                                                    **{**LOSS_KEYS, **keys}))
    return job, output


def ddp_job(cluster, tmp_path, name: str, steps: int = 40, spares: tuple[str, ...] = (),
            spare_vars: dict[str, dict] | None = None, **keys):
    """tests/assets/resumable.py (DDP, a checkpoint every 5 steps on shared storage, resumes on
    any world) that goes on without a lost host: (job, its checkpoint file)."""
    shared = cluster.shared_dir
    inventory = with_spares(cluster.write_inventory(tmp_path / "hosts.yml"), spares, spare_vars)
    shutil.copy(REPO / "tests" / "assets" / "resumable.py", shared / "resumable.py")
    ckpt = shared / "ckpt"
    job = write_job(tmp_path / "job.yaml", base_job(
        name, shared, inventory,
        {"script": str(shared / "resumable.py"), "args": ["--steps", str(steps), "--ckpt", str(ckpt)]},
        **{**LOSS_KEYS, **keys}))
    return job, ckpt / "latest.pt"


def wait_for(proc, predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"ftbundle ended before {what}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after {seconds}s"
        time.sleep(0.2)


def run_losing(cluster, job, ready, host: str, *, verbose: bool = True, ready_s: float = 400, end_s: float = 600,
               before_loss=lambda: None) -> tuple[int, str]:
    """`ftbundle run JOB`; once ``ready()`` (its first checkpoint), ``host``'s container is
    killed (after ``before_loss()``): (exit code, ftbundle's stderr)."""
    proc = start_ftbundle("run", *(["-v"] if verbose else []), str(job))
    try:
        wait_for(proc, ready, ready_s, "checkpoint")
        before_loss()
        cluster.kill(host)
        _, err = proc.communicate(timeout=end_s)
    finally:
        proc.kill()
    return proc.returncode, err


def test_a_killed_host_is_left_out_and_the_run_resumes_on_the_others_with_the_global_batch_kept(
        make_cluster, tmp_path):
    cluster = make_cluster(3)
    job, output = lora_job(cluster, tmp_path, "lose-node2")
    # (-v: rank 0's raw lines on the terminal; the run's curve is still kept from trainer_log.jsonl)
    code, err = run_losing(cluster, job, (output / "checkpoint-5" / "trainer_state.json").exists, "node2")
    assert code == 0, err[-4000:]
    assert re.search(r"attempt 2 on node\[0-1\]: node2 lost \([^)]*host unreachable\); "
                     r"global batch 12 kept: accumulation 2 -> 3", err), err[-4000:]
    resumed = re.search(rf"resuming from checkpoint-(\d+) of 30 in {re.escape(str(output))}", err)
    assert resumed, err[-4000:]
    step = int(resumed.group(1))
    run = only_run_dir(cluster.shared_dir)
    first, second = (run / "node-0-node0.a1.log").read_text(), (run / "node-0-node0.a2.log").read_text()
    assert TOTAL in first and TOTAL in second  # the same global batch on 3 ranks and on 2
    assert "Num examples" in second and f"Resuming training from {output}/checkpoint-{step}" in second
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 30 > step
    plan = json.loads((run / "plan.json").read_text())
    assert [n["host"] for n in plan["nodes"]] == ["node0", "node1"] and plan["world_size"] == 2
    staged = yaml.safe_load((run / "llamafactory.yaml").read_text())
    assert staged["gradient_accumulation_steps"] == 3
    # tokenized once: attempt 1 saved the tokenized dataset on shared storage, attempt 2 loaded it
    assert staged["tokenized_path"].startswith(f"{cluster.shared_dir}/cache/tokenized/")
    assert f"Tokenized dataset is saved at {staged['tokenized_path']}" in first
    assert f"Loaded tokenized dataset from {staged['tokenized_path']}" in second
    assert "Running tokenizer on dataset" not in second
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["attempt"] == 2
    assert [a["hosts"] for a in summary["attempts"]] == [["node0", "node1", "node2"], ["node0", "node1"]]
    assert "node2 lost" in summary["attempts"][1]["why"]
    recovery = summary["recovery"][0]  # where the time from the loss to attempt 2's first step went
    assert recovery == {"attempt": 2, **summary["attempts"][1]["recovery"]}, summary
    assert all(recovery[p] >= 0 for p in RECOVERY_PARTS) and recovery["resume"] > 0, recovery
    assert abs(sum(recovery[p] for p in RECOVERY_PARTS) - recovery["total"]) < 0.1, recovery
    assert re.search(r"^  attempt 2 trained again \d+ s after the failure: detection \d+ s, teardown", err, re.M), err
    assert "FTB_EXCLUDED_HOSTS=node2" in (run / "plan.json").read_text().replace('": "', "=")
    # the first real checkpoint replaced the check's estimate: its size, the room left, what the run still writes
    # (attempt 1 may be cut before it reads checkpoint-5: then attempt 2's first, checkpoint-10, is said)
    said = re.search(r"^ftbundle: (checkpoint-(?:5|10)) holds ([\d.]+) (KB|MB); (\d+) more fit in the [\d.]+ [GT]B free "
                     r"where output_dir is \(on node0\); the run writes 3 more \(save_total_limit 3\)$", err, re.M)
    assert said, err[-4000:]
    kept = output / said.group(1)
    size = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file()) if kept.exists() else None  # (rotated?)
    assert size is None or abs(size - float(said.group(2)) * (1e3 if said.group(3) == "KB" else 1e6)) < 0.2 * size
    assert job_processes(cluster) == {}
    # attempt 2's nodes are counted as its own: 2, not the first attempt's 3 ("nodes 2/3 finished")
    after = err[err.index("attempt 2 on node[0-1]"):]
    assert "launching on 2 node(s)" in after and "nodes 2/3" not in after, after[-3000:]
    # the first attempt's failure is said as the attempt's, not the run's (it read as if the run failed)
    assert re.search(r"^attempt 1 failed: host node\d", err, re.M), err[-4000:]
    assert not re.search(r"^failed: host", err, re.M), err[-4000:]
    # one curve per run: the lost host's attempt is kept beside attempt 2's (it held only the last attempt's)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["attempt"] for r in records} == {1, 2}, records
    assert min(r["current_steps"] for r in records if r["attempt"] == 2) > step
    # `ftbundle status` (node2 still down) and `ftbundle runs` say it too
    status = ftbundle("status", str(job), timeout=120)
    assert "attempt 2)" in status.stdout and "state: finished" in status.stdout, status.stdout + status.stderr
    assert re.search(r"^  attempt 2 on node\[0-1\]: node2 lost", status.stdout, re.M), status.stdout
    runs = ftbundle("runs", str(job), timeout=120)
    assert re.search(r"^  attempt 2 on node\[0-1\]: node2 lost .*accumulation 2 -> 3$", runs.stdout, re.M), runs.stdout
    assert re.search(r"^    attempt 2 trained again \d+ s after the failure: ", runs.stdout, re.M), runs.stdout
    assert re.search(r"^    attempt 2 trained again \d+ s after the failure: ", status.stdout, re.M), status.stdout


def test_a_cut_off_rank0_host_is_left_out_and_writes_nothing_once_the_run_went_on(make_cluster, tmp_path):
    cluster = make_cluster(3)
    job, output = lora_job(cluster, tmp_path, "cut-node0", steps=80)  # (attempt 2 still training when node0 is back)
    proc = start_ftbundle("run", "-v", str(job))
    healed = None
    try:
        wait_for(proc, lambda: (output / "checkpoint-5" / "trainer_state.json").exists(), 400, "checkpoint")
        cluster.partition("node0")
        run = only_run_dir(cluster.shared_dir)
        wait_for(proc, lambda: (run / "attempt").read_text().strip() == "2", 120, "attempt 2")
        began = (run / "attempt").stat().st_mtime
        wait_for(proc, lambda: (run / "node-0-node1.a2.log").exists(), 60, "attempt 2's rank 0 log")
        cluster.heal("node0")  # back during attempt 2
        healed = time.time()
        assert proc.poll() is None, "attempt 2 ended before node0 came back"
        assert not job_processes(cluster).get("node0"), job_processes(cluster)
        out, err = proc.communicate(timeout=600)
    finally:
        cluster.heal("node0")
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert re.search(r"attempt 2 on node\[1-2\]: node0 lost \([^)]*host unreachable\); "
                     r"global batch 12 kept: accumulation 2 -> 3", err), err[-4000:]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["master_addr"] == cluster.host("node1").ip  # rank 0's host was lost: MASTER_ADDR moved
    # node0 stopped its own job when the pings stopped, before attempt 2 began, and wrote nothing after
    stopped = run / "node-0.a1.stopped"
    assert stopped.exists() and stopped.stat().st_mtime < began
    assert "launcher lost" in (run / "node-0-node0.a1.log").read_text()
    # its node program's teller (remote/tell.py: its launcher gone) found attempt 1's end claimed by the
    # launcher as it went on: no word that the run stopped, while attempt 2 ran
    assert (run / "ended.a1").read_text().startswith("the launcher ("), (run / "ended.a1").read_text()
    node0_files = [p for p in run.iterdir() if p.name.startswith(("node-0.a1.", "node-0-node0.a1."))]
    assert node0_files and all(p.stat().st_mtime < began for p in node0_files), \
        [(p.name, p.stat().st_mtime - began) for p in node0_files]
    # nothing under output_dir was written by attempt 1 after attempt 2 began: every checkpoint
    # newer than that was written by attempt 2 (its steps come after the one it resumed from)
    resumed = int(re.search(r"resuming from checkpoint-(\d+) of 80", err).group(1))
    for ckpt in output.glob("checkpoint-*"):
        if ckpt.stat().st_mtime >= began:
            assert int(ckpt.name.split("-")[1]) > resumed, ckpt
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 80
    assert healed is not None and job_processes(cluster) == {}


def logged_step(log) -> int:
    """The last step a trainer log holds (a line caught mid-write is not one)."""
    steps = [0]
    for line in log.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["current_steps"]))
        except (ValueError, KeyError, TypeError):
            pass
    return max(steps)


def test_a_rank_whose_attempt_is_over_stops_before_it_writes(make_cluster, tmp_path):
    """The attempt fence alone (its node program's watchdog not involved): the run directory's
    `attempt` file moved on under a running LlamaFactory attempt, as it does when ftbundle goes
    on without a cut-off host. A rank ends at its next step's end (exit 97), saying so, the
    run is stopped, and no checkpoint is written after it. (The trainer logs every step: the step
    it had logged when the attempt moved bounds what may still be saved, as the step end after it
    reads the moved attempt before its save. Under CI's load the test's look can come several
    steps after checkpoint-5: the tiny model's steps take tens of ms; CI saw checkpoint-10.)"""
    cluster = make_cluster(2)
    job, output = lora_job(cluster, tmp_path, "fenced", restarts=0, on_node_loss="stop")
    proc = start_ftbundle("run", "-v", str(job))
    try:
        wait_for(proc, lambda: (output / "checkpoint-5" / "trainer_state.json").exists(), 400, "checkpoint")
        run = only_run_dir(cluster.shared_dir)
        (run / "attempt").write_text("2\n")
        logged = logged_step(output / "trainer_log.jsonl")
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]  # (torchrun's, for a rank that failed)
    assert "exit code 97" in err, err[-3000:]  # (the rank's own, whichever rank read it first)
    said = re.compile(r"ftbundle: attempt 1 is over \(the run is on attempt 2 without this host\): "
                      r"rank \d stops without writing")
    assert said.search(out + "".join(p.read_text() for p in run.glob("node-*.a1.log")))
    # none after it: a step that ended before the move (logged, or one more not logged yet) may save
    saved = sorted(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*"))
    assert saved[0] == 5 and saved[-1] <= logged + 1 and logged < 30, (saved, logged)
    assert not (output / "adapter_model.safetensors").exists()
    assert job_processes(cluster) == {}


def test_a_spare_takes_a_killed_hosts_place_after_its_check(make_cluster, tmp_path):
    """`on_node_loss: spare`: node3 of the `spares` group takes node1's place (rank 1) once the
    check passes on node0, node3, node2; the world stays 3, so does the accumulation."""
    cluster = make_cluster(4)
    # (stage: the model copied to each host's own disk: the spare gets its copy in its preflight)
    job, output = lora_job(cluster, tmp_path, "spare", spares=("node3",), on_node_loss="spare", stage=["model"])

    def spare_idle():
        assert not job_processes(cluster).get("node3")  # (a spare runs nothing until it is taken)
        assert cluster.exec("node3", "ls /var/cache/ftbundle 2>/dev/null | wc -l").stdout.strip() == "0"

    code, err = run_losing(cluster, job, (output / "checkpoint-5" / "trainer_state.json").exists, "node1",
                           before_loss=spare_idle)
    assert code == 0, err[-4000:]
    assert re.search(r"attempt 2 on node\[0,2-3\]: node1 lost \([^)]*\); node3 in place of node1; "
                     r"global batch 12 kept: accumulation 2 -> 2", err), err[-4000:]
    run = only_run_dir(cluster.shared_dir)
    plan = json.loads((run / "plan.json").read_text())
    assert [n["host"] for n in plan["nodes"]] == ["node0", "node3", "node2"]
    assert TOTAL in (run / "node-0-node0.a2.log").read_text()
    assert (run / "node-1-node3.a2.log").exists()
    # the spare was staged before it was taken: the others held the model already
    assert re.search(r"staged model \(.*tiny-llama-[0-9a-f]{16}\): copied to node3 in [\d.]+s \([\d.]+ MB/s\), "
                     r"cached on node\[0,2\]", err), err[-4000:]
    assert "/var/cache/ftbundle/tiny-llama-" in (run / "node-1-node3.a2.log").read_text()
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 30
    assert job_processes(cluster) == {}


def test_a_spare_that_fails_its_check_is_passed_over_for_the_next(make_cluster, tmp_path):
    """Two spares, the first one unfit (1024 CPU ranks asked of its 2 cores: the check refuses
    it, naming it): it is not taken, the second one is, and the run goes on from the checkpoint
    with world 3 (a DDP script, tests/assets/resumable.py)."""
    cluster = make_cluster(5)
    shared = cluster.shared_dir
    job, latest = ddp_job(cluster, tmp_path, "spare-check", spares=("node3", "node4"),
                          spare_vars={"node3": {"ftb_nproc_per_node": 1024}}, on_node_loss="spare")
    code, err = run_losing(cluster, job, latest.exists, "node1", verbose=False, ready_s=300, end_s=300)
    assert code == 0, err[-4000:]
    assert "spare node3 did not pass the preflight (see above): not taken; trying node4" in err, err[-4000:]
    assert re.search(r"node3\b.*1024|1024.*\bnode3\b", err), err[-4000:]  # (the check's own words name it)
    assert re.search(r"attempt 2 on node\[0,2,4\]: node1 lost \([^)]*\); node4 in place of node1", err), err[-4000:]
    run = only_run_dir(shared)
    plan = json.loads((run / "plan.json").read_text())
    assert [n["host"] for n in plan["nodes"]] == ["node0", "node4", "node2"] and plan["world_size"] == 3
    assert "resuming from step" in (run / "node-0-node0.a2.log").read_text()
    assert not job_processes(cluster).get("node3")
    assert job_processes(cluster) == {}


def test_below_min_nodes_the_run_stops_with_255_naming_the_lost_host(make_cluster, tmp_path):
    cluster = make_cluster(2)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("min-nodes", cluster.shared_dir, inventory,
                                                    {"command": 'echo "up $NODE_RANK"; sleep 120'}, restarts=2,
                                                    on_node_loss="exclude", min_nodes=2))
    proc = start_ftbundle("run", "-v", str(job))
    try:
        assert "up 0" in proc.stdout.readline()
        cluster.kill("node1")
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 255, err
    assert re.search(r"stopping: node1 lost \([^)]*host unreachable\); 1 host\(s\) left, fewer than min_nodes 2 "
                     r"\(lost: node1\)", err), err
    run = only_run_dir(cluster.shared_dir)
    assert not list(run.glob("*.a2.*"))
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 255
    assert job_processes(cluster) == {}


def test_a_command_job_is_told_its_new_world_and_the_hosts_left_out(make_cluster, tmp_path):
    """`command:` mode: attempt 2 gets the new NNODES and NODE_RANK, FTB_ATTEMPT and
    FTB_EXCLUDED_HOSTS (what it must adjust itself by)."""
    cluster = make_cluster(3)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    command = ('echo "world $FTB_ATTEMPT $NNODES $NODE_RANK [${FTB_EXCLUDED_HOSTS:-}] $(hostname)" '
               '>> "$FTB_RUN_DIR/world.txt"; if [ "$FTB_ATTEMPT" = 1 ]; then sleep 120; fi')
    hook = Hook()  # (told once of the lost host while the run goes on, once of its end: issue 47 item 3)
    job = write_job(tmp_path / "job.yaml", base_job("told", cluster.shared_dir, inventory, {"command": command},
                                                    restarts=1, on_node_loss="exclude", notify={"webhook": hook.url}))
    proc = start_ftbundle("run", str(job))
    try:
        wait_for(proc, lambda: len(list(cluster.shared_dir.glob("runs/*/world.txt"))) == 1 and len(
            next(cluster.shared_dir.glob("runs/*/world.txt")).read_text().splitlines()) == 3, 120, "3 nodes up")
        cluster.kill("node1")
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "attempt 2 on node[0,2]: node1 lost (" in err and "batch" not in err.split("attempt 2 on")[1].splitlines()[0]
    lines = (only_run_dir(cluster.shared_dir) / "world.txt").read_text().splitlines()
    assert sorted(lines[3:]) == ["world 2 2 0 [node1] node0", "world 2 2 1 [node1] node2"], lines
    assert job_processes(cluster) == {}
    hook.close()
    assert [summary["state"] for _, summary in hook.posts] == ["host lost", "finished"], hook.posts
    lost = hook.posts[0][1]
    assert list(lost["lost"]) == ["node1"] and lost["hosts"] == ["node0", "node2"] and lost["attempt"] == 2, lost
    assert "notify: webhook" in err and "told (host lost)" in err
