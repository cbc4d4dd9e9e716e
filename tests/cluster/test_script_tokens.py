"""A script that counts its own tokens (issue 47 item 1, script jobs): ``StepClock.step_done(tokens=N)``
on two containerized hosts, real torchrun, gloo. The run's tokens are every rank's count, its tokens/s
the sum of the ranks' rates, per rank half of it: in the summary, summary.json and `runs`."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import base_job, ftbundle, only_run_dir, write_job

pytestmark = pytest.mark.cluster

COUNTING = """\
import os, sys, time
import torch.distributed as dist
sys.path.insert(0, os.environ["FTB_RUN_DIR"])
from ftb_steptimes import StepClock

dist.init_process_group("gloo")
clock = StepClock()
for step in range(41):
    clock.begin()
    time.sleep(0.05)  # (its compute)
    clock.mark()
    dist.barrier()
    clock.step_done(tokens=256)
clock.finish()
dist.destroy_process_group()
"""


def run_script(make_cluster, tmp_path, source: str, gpus: str | None = None):
    """``source`` as the script of a job on two containerized hosts (with the nvidia-smi stand-in
    replaying ``gpus`` on each, where given), run to its end: (the job, the run, its summary.json)."""
    from tests.support.helpers import install_smi

    cluster = make_cluster(2)
    shared = cluster.shared_dir
    for host in ("node0", "node1") if gpus else ():
        install_smi(cluster, host, gpus)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "train.py").write_text(source)
    job = write_job(tmp_path / "job.yaml", base_job("tokens", shared, inventory, {"script": "train.py"},
                                                    workdir=str(shared)))
    proc = ftbundle("run", str(job), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return job, proc, json.loads((only_run_dir(shared) / "summary.json").read_text())


def test_a_scripts_own_token_count_gives_the_runs_tokens_per_second(make_cluster, tmp_path):
    job, proc, summary = run_script(make_cluster, tmp_path, COUNTING)
    assert summary["tokens"] == 2 * 40 * 256, summary  # every rank's 40 counted steps after its first
    rate, per = summary["tokens_per_s"], summary["tokens_per_s_per_rank"]
    # each rank: 256 tokens a step of a little over 50 ms (its sleep, the barrier, a loaded machine)
    assert 2 * 256 / 0.5 <= rate <= 2 * 256 / 0.05, summary
    assert per == pytest.approx(rate / 2, rel=0.01)
    assert "tokens       " in proc.stdout + proc.stderr and "per rank" in proc.stdout + proc.stderr
    runs = ftbundle("runs", str(job), timeout=60)
    assert f"{rate:,.0f}" in runs.stdout, runs.stdout


WATCHED = """\
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["FTB_RUN_DIR"])
from ftb_steptimes import StepClock

dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))  # 262,912 parameters
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
clock = StepClock()
clock.watch(model)  # (the model itself, not its DDP wrapper)
for step in range(31):
    ddp(torch.randn(8, 256)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.03)
    clock.step_done(tokens=128)
clock.finish()
dist.destroy_process_group()
"""


def test_a_scripts_model_watched_by_the_step_clock_gives_the_runs_mfu(make_cluster, tmp_path):
    """On GPU hosts (the nvidia-smi stand-in replays a real H100 box: the plan counts against
    989 TFLOP/s), a script whose StepClock watches its model: its ranks count its parameters and
    send them beside their tokens over the node channel, and the run's MFU is 6 x those x tokens/s
    over 2 x 989 TFLOP/s, by hand from summary.json's own tokens/s. (The ranks run gloo on the
    CPU: the figure is tiny and exact.)"""
    _, proc, summary = run_script(make_cluster, tmp_path, WATCHED, gpus="h100-x8")
    params = 256 * 512 + 512 + 512 * 256 + 256
    assert summary["tokens"] == 2 * 30 * 128, summary
    assert summary["mfu"] == pytest.approx(6 * params * summary["tokens_per_s"] / (2 * 989e12), rel=0.001), summary
    assert summary["mfu_basis"].startswith(f"6 x {params:,} parameters per token, counted by the script's "
                                           "StepClock on its model "), summary
    assert summary["mfu_basis"].endswith("over 2 x H100 SXM at 989 TFLOP/s dense bf16"), summary
    assert "  MFU          0.0%: 6 x 262,912 parameters per token, counted by the script's StepClock" in \
        proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
