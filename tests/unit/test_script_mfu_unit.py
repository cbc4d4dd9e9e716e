"""MFU for a script's own training loop (issue 47 item 1, script jobs): the ranks' StepClock counts
the model's parameters when it watches it (real torch modules: plain, FSDP1's flat parameters,
FSDP2's DTensors), sends them beside its tokens, and the launcher counts MFU against them: on the
live line, in the summary and summary.json, by hand here. A count that would be a slice's is
left out and said, not used."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ftbundle import speed as S
from ftbundle.history import speed_record
from ftbundle.protocol import parse_steps
from ftbundle.shims.steptimes import StepClock, count_params
from ftbundle.ui.progress import Progress, status_fields
from ftbundle.ui.summary import closing_summary

torch = pytest.importorskip("torch")


def model():
    """64 x 32 + 32 and 32 x 8 + 8 parameters: 2,344."""
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))


def test_the_step_clock_counts_the_model_it_watches_and_sends_the_count_beside_its_tokens(tmp_path):
    assert count_params(model()) == 64 * 32 + 32 + 32 * 8 + 8 == 2344
    clock = StepClock(str(tmp_path / "a1.steps"), "0")
    net = model()
    clock.watch(net)
    assert clock.params == 2344
    for _ in range(3):
        net(torch.randn(4, 64)).sum().backward()
        clock.step_done(tokens=100)
    clock.finish()
    line = (tmp_path / "a1.steps.0").read_text().split()
    assert len(line) == 7 and line[4] == "200" and line[6] == "2344", line
    (rank,) = parse_steps(" ".join(line))
    assert (rank.tokens, rank.params) == (200, 2344)
    # given by the script (a model split by hand): that figure, not the watched one
    given = StepClock(str(tmp_path / "b.steps"), "0", params=8_030_261_248)
    given.watch(model())
    assert given.params == 8_030_261_248
    # no tokens counted: the line is as before (the count travels only with tokens: MFU needs both)
    quiet = StepClock(str(tmp_path / "c.steps"), "0")
    quiet.watch(model())
    quiet.begin()
    quiet.mark()
    quiet.step_done()
    quiet.finish()
    assert len((tmp_path / "c.steps.0").read_text().split()) == 4
    # lines of the shape before (6 fields) and broken ones parse as before
    assert parse_steps("0 5 0.1 0.2 300 1.5")[0].params is None
    assert parse_steps("0 5 0.1 0.2 300 1.5 x") == [] and parse_steps("0 5 0.1 0.2 300 1.5 0")[0].params is None


def test_parameters_that_hold_the_whole_model_count_and_a_slice_does_not():
    # DeepSpeed ZeRO-3 keeps each parameter's whole size in ds_numel (its data is this rank's partition)
    net = model()
    for param in net.parameters():
        param.ds_numel, param.data = param.numel(), param.data.flatten()[:1].clone()
    assert count_params(net) == 2344
    # bitsandbytes' 4-bit weight: packed data (half the elements), the shape it came from in
    # quant_state.shape (bitsandbytes' QuantState; bitsandbytes itself needs its GPU build)
    packed = model()
    weight = packed[0].weight
    weight.quant_state = type("QuantState", (), {"shape": torch.Size([32, 64])})()
    weight.data = weight.data.flatten()[: 32 * 64 // 2].clone()
    assert count_params(packed) == 2344
    # FSDP1 (flat parameters: this rank's slice of many) and FSDP2 (DTensors: numel is the global
    # shape), real, with gloo on one process
    out = subprocess.run([sys.executable, "-c", FSDP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["fsdp1=None", "fsdp2=2344"], out.stdout + out.stderr[-2000:]


FSDP = """
import os, socket, torch, torch.distributed as dist
from ftbundle.shims.steptimes import count_params
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
def model():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
inner = model()
FullyShardedDataParallel(inner, device_id=torch.device("cpu"))
two = model()
fully_shard(two)
print(f"fsdp1={count_params(inner)}", f"fsdp2={count_params(two)}")
dist.destroy_process_group()
"""


def test_the_launcher_counts_mfu_against_the_parameters_the_ranks_counted():
    basis = S.SpeedBasis(ranks=16, gpus=16, gpu="H100 SXM", peak_tflops=989.0)
    assert basis.mfu(1000) is None and basis.mfu_basis().startswith("MFU unknown: the model's parameters were not")
    p = Progress(speed=basis)
    for host in ("node0", "node1"):
        p.feed_steps(host, ";".join(f"{r} 40 0.5 0.6 40000 10.0 8030261248" for r in range(8)), now=time.monotonic())
    # 16 ranks of 4,000 tokens/s = 64,000; MFU by hand: 6 x 8.03e9 x 64,000 / (16 x 989e12) = 19.49%
    assert p.tokens_per_s() == 64_000
    assert p.mfu() == pytest.approx(6 * 8_030_261_248 * 64_000 / (16 * 989e12))
    assert f"{p.mfu():.2%}" == "19.49%"
    assert dict(status_fields(p, 1, 1))["mfu"] == "19.5%"
    said = p.speed.mfu_basis()
    assert said.startswith("6 x 8.03B parameters per token, counted by the script's StepClock on its model "), said
    lines = closing_summary(run_id="r", run_dir="/d", duration_s=60, progress=p, output_dir=None, adapter=None,
                            nnodes=2)
    assert f"  MFU          19.5%: {said}" in lines, lines
    rec = speed_record(p)
    assert rec["mfu"] == pytest.approx(0.1949, abs=1e-4) and rec["mfu_basis"] == said
    # a LlamaFactory job's count (from its model's files) is not replaced by a rank's
    lf = Progress(speed=S.SpeedBasis(ranks=1, gpus=1, gpu="H100 SXM", peak_tflops=989.0, params=10**9))
    lf.feed_steps("node0", "0 40 0.5 0.6 40000 10.0 1234", now=time.monotonic())
    assert lf.speed.params == 10**9 and lf.speed.params_from is None
    # on CPUs: no MFU, whatever is counted
    cpu = Progress(speed=S.SpeedBasis(ranks=2))
    cpu.feed_steps("node0", "0 40 0.5 0.6 40000 10.0 2344", now=time.monotonic())
    assert cpu.mfu() is None and cpu.speed.params is None


def test_ranks_that_count_different_parameters_hold_parts_of_the_model_and_mfu_is_unknown():
    """Tensor or pipeline parallel by hand: each rank's model is its part. MFU against one part
    would look right and be several times too low: unknown, said, until the script says the whole."""
    p = Progress(speed=S.SpeedBasis(ranks=2, gpus=2, gpu="H100 SXM", peak_tflops=989.0))
    p.feed_steps("node0", "0 40 0.5 0.6 40000 10.0 4000000000", now=time.monotonic())
    assert p.mfu() is not None  # (one rank heard so far)
    p.feed_steps("node1", "0 40 0.5 0.6 40000 10.0 4030261248", now=time.monotonic())
    assert p.mfu() is None
    assert p.speed.mfu_basis() == ("MFU unknown: the script's ranks counted different parameters (4,000,000,000, "
                                   "4,030,261,248): a model split across them; give StepClock(params=N), the whole "
                                   "model's, on every rank")
    assert "mfu" not in dict(status_fields(p, 1, 1))
    # the basis as plan.json and summary.json keep it reads back the same
    assert S.SpeedBasis.from_record(p.speed.record()) == p.speed


def test_on_a_gpu_the_tokens_clock_is_the_gpus_not_the_hosts(tmp_path, monkeypatch):
    """The host queues a step's kernels and runs ahead: its clock would count the queue. On a GPU
    each counted step's end is a CUDA event, its tokens counted once the GPU has passed it, the
    seconds between the events'. (torch.cuda.Event stands in here as a clock the test moves: this
    machine has no GPU; tests/gpu/test_gpu.py runs the real one against a synchronized wall.)"""
    gpu_now = [0.0]

    class Event:  # query / synchronize / elapsed_time, as torch.cuda.Event has them
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = "queued"

        def query(self):
            return self.at != "queued"

        def synchronize(self):
            if self.at == "queued":
                self.at = gpu_now[0]

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = StepClock(str(tmp_path / "a1.steps"), "0", params=1000)
    clock._cuda = True  # (as watch() sets it for a model on a GPU)
    clock.times.append(0.01)  # (a step time, so the line is written)
    for _ in range(5):  # the host queues 5 steps at once, in no time
        clock.step_done(tokens=100)
    assert clock.tokens == 0 and clock.line().split()[4:] == []  # nothing passed: nothing counted yet
    first, second, *rest = [event for _, event in clock._token_events]
    first.at, second.at = 0.0, 2.0  # the GPU ran the first two steps: 2 s for the second
    clock.step_done(tokens=100)
    assert clock.line().split()[4:] == ["100", "2.000000", "1000"]
    gpu_now[0] = 10.0
    clock.finish()  # (waits for the rest: each passed at 10 s)
    assert clock.line().split()[4:] == ["500", "10.000000", "1000"]
