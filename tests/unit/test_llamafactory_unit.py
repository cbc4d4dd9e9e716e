"""The seeds' traps, turned into warnings before launch (pure: job + hosts -> plan)."""

import os
import re
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.errors import UserError
from ftbundle.facts import ClusterFacts, HostFacts, bf16_capable, parse_nvidia_smi
from ftbundle.inventory import load_hosts
from ftbundle.job import load_job
from tests.support.helpers import free_port, plan_of
from ftbundle.rundir import LLAMAFACTORY_CONFIG

DATA = Path(__file__).parents[1] / "data" / "nvidia-smi"
INVENTORY = """
all:
  children:
    trainers:
      hosts:
        gpu-0: {ansible_host: 10.9.0.10}
        gpu-1: {ansible_host: 10.9.0.11}
        gpu-2: {ansible_host: 10.9.0.12}
        gpu-3: {ansible_host: 10.9.0.13}
"""
GOOD = {"model_name_or_path": "org/model", "stage": "sft", "do_train": True, "finetuning_type": "lora", "dataset": "support",
        "output_dir": "/shared/out/lora", "save_total_limit": 3, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "bf16": True}


def plan(tmp_path, config: dict, *, gpus=None, nproc=8):
    """The plan on 4 hosts; ``gpus``: what each host's probe found (None: hosts not asked)."""
    (tmp_path / "hosts.yml").write_text(INVENTORY)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "job.yaml").write_text(
        f"name: lf\ninventory: hosts.yml\nhosts: trainers\nnproc_per_node: {nproc}\n"
        "shared_dir: /shared\ntrain: {llamafactory: train.yaml}\n")
    job = load_job(tmp_path / "job.yaml")
    hosts = load_hosts(tmp_path / "hosts.yml", "trainers")
    facts = None if gpus is None else ClusterFacts([HostFacts(h.name, r, gpus=gpus) for r, h in enumerate(hosts)])
    return plan_of(job, hosts, "r1", facts)


def staged(p) -> dict:
    return yaml.safe_load(p.files[LLAMAFACTORY_CONFIG])


def test_a_sound_config_has_no_warning_and_says_its_effective_batch(tmp_path):
    p = plan(tmp_path, GOOD)
    assert p.warnings == ()
    assert p.notes == ("effective batch size 256 = 4 per device x 2 accumulation x 8 rank(s) per node "
                       "x 4 node(s)",)
    # the trainer counts its tokens (tokens/s, MFU: ftbundle.speed); without the hosts' facts
    # the transformers version is unknown: every token, padding included, said so
    assert staged(p) == {**GOOD, "include_num_input_tokens_seen": True} and p.speed.padding is True


def test_output_dir_not_on_shared_storage(tmp_path):
    p = plan(tmp_path, {**GOOD, "output_dir": "/data/local/out"})
    [warning] = p.warnings
    assert warning.startswith("output_dir /data/local/out is not under the shared directory /shared")
    assert "lost with the node" in warning


def test_relative_output_dir_lands_under_the_workdir_on_shared_storage(tmp_path):
    p = plan(tmp_path, {**GOOD, "output_dir": "output/lora"})
    assert p.warnings == () and p.checkpoint_dir == "/shared/output/lora"


def test_no_save_total_limit(tmp_path):
    config = {k: v for k, v in GOOD.items() if k != "save_total_limit"}
    [warning] = plan(tmp_path, config).warnings
    assert warning == "save_total_limit is not set: every checkpoint is kept until the disk is full"
    assert plan(tmp_path, {**config, "save_strategy": "no"}).warnings == ()


def test_huge_ddp_timeout_is_capped_in_the_staged_config(tmp_path):
    p = plan(tmp_path, {**GOOD, "ddp_timeout": 180000000})
    [warning] = p.warnings
    assert warning.startswith("ddp_timeout 180000000 s capped to 1800 s")
    assert staged(p)["ddp_timeout"] == 1800  # what the ranks read
    assert staged(plan(tmp_path, {**GOOD, "ddp_timeout": 600}))["ddp_timeout"] == 600


@pytest.mark.parametrize("sample, capable", [("h100-x8.csv", True), ("a100-x4.csv", True),
                                              ("v100-x8.csv", False), ("t4-x2-no-compute-cap.csv", False),
                                              ("mixed-h100-a100.csv", True)])
def test_fp16_on_a_bf16_capable_gpu(tmp_path, sample, capable):
    gpus = parse_nvidia_smi((DATA / sample).read_text())
    assert bf16_capable(gpus) is capable
    config = {**GOOD, "bf16": False, "fp16": True}
    warnings = plan(tmp_path, config, gpus=gpus, nproc=len(gpus)).warnings
    if capable:
        assert warnings == ("fp16 on a bf16-capable GPU: bf16 needs no loss scaling and overflows less; "
                            "set bf16: true, fp16: false",)
    else:  # V100/T4: fp16 is the right choice
        assert warnings == ()


def test_dry_run_shows_the_warnings_and_the_effective_batch(tmp_path, capsys):
    plan(tmp_path, {**GOOD, "ddp_timeout": 180000000, "output_dir": "/scratch/out"})
    assert main(["run", str(tmp_path / "job.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "effective batch size 256 = 4 per device x 2 accumulation x 8 rank(s) per node x 4 node(s)" in out
    assert "warning: ddp_timeout 180000000 s capped to 1800 s" in out
    assert "warning: output_dir /scratch/out is not under the shared directory /shared" in out


def test_deepspeed_json_beside_the_config_travels_with_the_job(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "ds_z3_config.json").write_text('{"zero_optimization": {"stage": 3}}')
    p = plan(tmp_path, {**GOOD, "deepspeed": "ds/ds_z3_config.json"})
    assert p.files["deepspeed.json"] == '{"zero_optimization": {"stage": 3}}'
    assert staged(p)["deepspeed"] == f"{p.run_dir}/deepspeed.json"  # on shared storage, for every host
    # a path that is not here is the hosts' business (e.g. inside the image): left alone
    p = plan(tmp_path, {**GOOD, "deepspeed": "/opt/ds/z2.json"})
    assert "deepspeed.json" not in p.files and staged(p)["deepspeed"] == "/opt/ds/z2.json"


def test_deepspeed_json_that_is_not_json_is_bad_input(tmp_path):
    (tmp_path / "z3.json").write_text("{stage: 3")
    with pytest.raises(UserError) as info:
        plan(tmp_path, {**GOOD, "deepspeed": "z3.json"})
    assert info.value.key == "deepspeed" and str(tmp_path / "z3.json") in str(info.value)


def test_a_finished_rank_leaves_after_its_exit_handlers_and_flush_without_finalization(tmp_path):
    """The LlamaFactory entry's leave(): atexit handlers run and buffered output is flushed
    (nothing a trainer or logger registered is lost), then the process ends without
    interpreter finalization, where torch 2.14 sometimes aborts a rank that has finished."""
    import subprocess
    import sys

    program = f"""
import atexit, sys
from ftbundle.shims.llamafactory_entry import leave
atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
class Finalized:
    def __del__(self, open=open):  # builtins may be gone by then
        open({str(tmp_path / "finalized")!r}, "w").write("ran")
keep = Finalized()
sys.stdout.write("saved, no newline")
sys.stderr.write("err, no newline")
leave(0)
raise SystemExit(3)
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "saved, no newline"
    assert proc.stderr.endswith("err, no newline")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "finalized").exists()  # finalization (and C++ static destructors) skipped
    # the control: the same object is finalized on a normal exit
    normal = program.replace("leave(0)\nraise SystemExit(3)", "")
    assert subprocess.run([sys.executable, "-c", normal], capture_output=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2]).returncode == 0
    assert (tmp_path / "finalized").read_text() == "ran"


EXIT_WAIT = """
import atexit, os, sys, time
import mlflow
import ftbundle.shims.llamafactory_entry as entry
def slow():  # (an exit handler still sending: MLflow's queue, W&B's upload)
    time.sleep(float(os.environ["HANDLER_S"]))
    print("HANDLER DONE", flush=True)
atexit.register(slow)
mlflow.set_tracking_uri(os.environ["URI"])
entry._MLFLOW_END_DEFERRED = os.environ["DEFERRED"] == "1"  # (rank 0 logged to MLflow; no run active here)
entry.leave(0)
"""


def exit_waiting(uri: str, deferred: bool, handler_s: float) -> tuple:
    """The entry's leave() under FTB_TRACKERS_END_S=2 with an exit handler that takes handler_s:
    (the process, its seconds)."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "URI": uri, "DEFERRED": "1" if deferred else "0", "HANDLER_S": str(handler_s),
           "FTB_TRACKERS_END_S": "2", "RANK": "0"}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", EXIT_WAIT], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    return proc, time.monotonic() - began


def test_a_finished_ranks_exit_is_cut_only_on_evidence_of_a_trackers_server_in_trouble():
    """leave()'s bound (FTB_TRACKERS_END_S) ends a finished rank's exit handlers only where a tracker's
    server is in trouble: MLflow's server refusing its connect (a real closed port) cuts a 60 s
    handler at the limit, said with the server and why; with a server that answers (here a listening
    socket), and with no tracker at all, a handler that outlasts the limit (a healthy upload) runs to
    its end, and nothing is said."""
    import socket

    port = free_port()
    proc, took = exit_waiting(f"http://ann:secret@127.0.0.1:{port}", deferred=True, handler_s=60)
    assert proc.returncode == 0 and took < 30, (took, proc.stderr[-2000:])
    assert "HANDLER DONE" not in proc.stdout
    assert re.search(rf"ftbundle: warning: rank 0 finished and saved, and waited \d+ s \(FTB_TRACKERS_END_S\) on "
                     rf"mlflow's server http://127.0.0.1:{port} \(Connection refused; its run may stay RUNNING there\): "
                     "it leaves without them", proc.stderr), proc.stderr[-2000:]
    assert "secret" not in proc.stderr

    with socket.socket() as server:  # (a server that answers: the wait is a healthy one)
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        proc, took = exit_waiting(f"http://127.0.0.1:{server.getsockname()[1]}", deferred=True, handler_s=5)
    assert proc.returncode == 0 and "HANDLER DONE" in proc.stdout, proc.stderr[-2000:]
    assert "warning" not in proc.stderr and took >= 5
    proc, took = exit_waiting(f"http://127.0.0.1:{port}", deferred=False, handler_s=5)  # (MLflow not used)
    assert proc.returncode == 0 and "HANDLER DONE" in proc.stdout, proc.stderr[-2000:]
    assert "warning" not in proc.stderr and took >= 5
