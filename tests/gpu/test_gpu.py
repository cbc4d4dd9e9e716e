"""Real GPUs, where there are any (the ``gpu`` marker: skipped on machines without one).

On a machine with a GPU (a lent GPU machine), the probe's three nvidia-smi queries are
run for real, their outputs recorded into tests/data/nvidia-smi/recorded/ (with where and
when in recorded/SOURCES.md), and read back by the same parsers `ftbundle check` uses;
then the probe itself runs and must report the same GPUs. The hand-made samples beside
them (tests/data/nvidia-smi/*.csv) are format samples; the recorded ones are the check
that the format is the real one. Commit what was recorded.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from ftbundle.facts import add_gpu_ids, parse_compute_apps, parse_facts, parse_nvidia_smi
from ftbundle.remote.probe import APPS_QUERY, GPU_IDS_QUERY, GPU_QUERY
from tests.support import helpers
from tests.unit.test_check_unit import SMI, local_spec, run_probe

RECORDED = Path(os.environ.get("FTB_SMI_RECORD_DIR") or SMI / "recorded")
BASE = ["nvidia-smi", "--format=csv,noheader,nounits"]
QUERIES = {  # file suffix -> the probe's query, as ftbundle/remote/probe.py asks it
    ".csv": f"--query-gpu={GPU_QUERY},compute_cap",
    ".ids.csv": f"--query-gpu={GPU_IDS_QUERY}",
    ".apps.csv": f"--query-compute-apps={APPS_QUERY}",
}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def listed_gpus() -> tuple[str, str]:
    """`nvidia-smi -L` as printed, and the recorded files' sample name (`nvidia-h100-80gb-hbm3-x1`)."""
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    return listing, f"{slug(listing.split(': ', 1)[1].split(' (UUID')[0])}-x{listing.count('GPU ')}"


def record_nvidia_smi(out_dir: Path, env: dict | None = None) -> tuple[str, dict[str, str]]:
    """Run the probe's queries on this machine and write each output as nvidia-smi printed
    it: ``<gpu-name>-x<count><suffix>``. Returns (sample name, suffix -> text)."""
    outputs = {}
    for suffix, query in QUERIES.items():
        proc = subprocess.run([*BASE, query], capture_output=True, text=True, timeout=60, env=env, check=False)
        assert proc.returncode == 0, f"nvidia-smi {query}: exit {proc.returncode}: {proc.stdout}{proc.stderr}"
        outputs[suffix] = proc.stdout
    gpus = parse_nvidia_smi(outputs[".csv"])
    assert gpus, outputs[".csv"]
    sample = f"{slug(gpus[0].name)}-x{len(gpus)}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for suffix, text in outputs.items():
        (out_dir / f"{sample}{suffix}").write_text(text)
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, env=env,
                             check=False).stdout.strip().splitlines()
    with open(out_dir / "SOURCES.md", "a") as sources:
        sources.write(f"- `{sample}.*`: recorded {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
                      f"on {socket.gethostname()} by tests/gpu/test_gpu.py, driver {gpus[0].driver}; "
                      f"`nvidia-smi -L`: {'; '.join(listing) or '(nothing)'}\n")
    return sample, outputs


@pytest.mark.gpu
def test_real_nvidia_smi_is_recorded_and_read_as_the_check_reads_it(tmp_path):
    sample, out = record_nvidia_smi(RECORDED)
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    uuids = re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", listing)
    gpus = add_gpu_ids(parse_nvidia_smi(out[".csv"]), out[".ids.csv"])
    assert len(gpus) == len(uuids) > 0, (listing, out)
    assert [g.uuid for g in gpus] == uuids  # the ids query lined up with the GPU list
    for g in gpus:
        assert g.memory_mib and g.memory_mib > 1024 and g.compute_cap_tuple is not None, g
        assert g.memory_used_mib is not None, g
    parse_compute_apps(out[".apps.csv"])  # may be empty; must parse
    # the probe, for real, sees the same GPUs
    facts = parse_facts("here", 0, run_probe(local_spec(tmp_path)))
    assert facts.gpu_error is None and [g.uuid for g in facts.gpus] == uuids, facts
    assert (RECORDED / f"{sample}.csv").read_text() == out[".csv"]


@pytest.mark.gpu
def test_real_gpu_health_is_read_in_every_field(tmp_path):
    """The check's GPU health questions (issue 37) asked by the probe itself on this machine's
    GPUs: every field of the query parses to a value (what a GPU of its kind cannot say aside:
    retired pages on GPUs that remap rows), the temperature threshold is found, the kernel log
    is read (as root), and the outputs are recorded beside the others."""
    from ftbundle import gpu_health as H
    from ftbundle.check import rules as R

    spec = local_spec(tmp_path, health={"fields": list(H.HEALTH_FIELDS), "aliases": H.FIELD_ALIASES,
                                        "window_s": H.XID_WINDOW_S})
    data = run_probe(spec)
    f = parse_facts("here", 0, data)
    raw = data.get("health") or {}
    assert f.health_error is None and f.gpu_health, raw
    assert [g.uuid for g in f.gpu_health] == [g.uuid for g in f.gpus]
    for g in f.gpu_health:
        known = {k: getattr(g, k) for k in ("uuid", "bus_id", "ecc_mode", "remap_pending", "remap_failure",
                                            "clock_events", "sm_clock_mhz", "sm_clock_max_mhz", "temperature_c",
                                            "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max")}
        assert None not in known.values(), (known, raw.get("query"))
        assert g.ecc_mode != "Enabled" or g.ecc_uncorrected is not None, raw.get("query")
        assert g.slowdown_c is not None or (g.tlimit_c is not None and g.slowdown_tlimit_c is not None), g
    if os.geteuid() == 0:
        assert f.kernel_log_error is None, raw.get("kernel_log")
    check = R.check_health([f], "refuse")
    assert check.ok, check.details  # a lent machine's GPU is expected healthy; if not, this says why
    sample = f"{slug(f.gpus[0].name)}-x{len(f.gpus)}"
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.health.csv").write_text(raw["query"])
    (RECORDED / f"{sample}.temperature.txt").write_text(raw.get("temperature") or "")
    with open(RECORDED / "SOURCES.md", "a") as sources:
        sources.write(f"- `{sample}.health.csv`, `{sample}.temperature.txt`: the probe's health query and "
                      f"`nvidia-smi -q -d TEMPERATURE`, recorded {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
                      f"UTC on {socket.gethostname()} by tests/gpu/test_gpu.py; findings: "
                      f"{'; '.join(check.warnings) or 'none'}\n")


def burn_in_here(tmp_path: Path, seconds: float):
    """`check --burn-in SECONDS` of a one-host job on this machine (its report)."""
    from ftbundle.check.burnin import run_burnin
    from ftbundle.commands.common import load_layout, open_cluster
    from ftbundle.plan import make_plan
    from tests.unit.test_check_local_unit import local_job

    (tmp_path / ".shared").mkdir()
    _, layout = load_layout(str(local_job(tmp_path, train={"command": "true"}, nproc_per_node=1)), None)
    with open_cluster(layout.hosts) as cluster:
        return run_burnin(make_plan(layout), cluster, seconds=seconds)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_real_gpu_burn_in_measures_every_gpu(tmp_path):
    """`check --burn-in 20` (issue 37 items 2 and 5) on this machine's GPUs, all at once: each
    GPU's bf16 GEMM (8192^3) and HBM copy (1 GiB, read + write), as ../shared/gpu/check/health.sh
    measured them on an H100 (780 TFLOP/s, 2.99 TB/s). The figures are kept in burnin.json,
    recorded beside the nvidia-smi readings, and printed for the docs. One healthy machine's
    GPUs are alike: none is named slow."""
    import json

    report = burn_in_here(tmp_path, 20)
    assert report.ok, report.errors
    gpus = {f.device for f in report.figures}
    count = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout.count("GPU ")
    assert len(gpus) == count and all(d.startswith("GPU ") for d in gpus), report.figures
    for f in report.figures:  # far below any GPU a bf16 fine-tune runs on: a unit or timing mistake
        assert f.value > (20 if f.metric == "gemm_bf16_tflops" else 200), f
    assert not report.slow, [s.line() for s in report.slow]
    kept = json.loads((Path(report.check_dir) / "burnin.json").read_text())
    node = kept["nodes"]["localhost"]
    # each GPU's GEMM kept for later runs' MFU on GPUs the table does not know (check/burnin.py gemm_record)
    gemm = json.loads((Path(report.check_dir).parent / "gemm.json").read_text())
    assert report.gemm_kept == str(Path(report.check_dir).parent / "gemm.json")
    assert {u: g["tflops"] for u, g in gemm["gpus"].items()} == {
        d["uuid"]: round(d["gemm_bf16_tflops"], 2) for d in node["devices"]}, gemm
    sample = f"{slug(node['devices'][0]['name'])}-x{count}"
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.burnin.json").write_text(json.dumps(node, indent=2) + "\n")
    figures = "; ".join(f"{d['device']}: bf16 GEMM {d['gemm_bf16_tflops']:.0f} TFLOP/s, HBM copy "
                        f"{d['hbm_copy_gbps']:.0f} GB/s" for d in node["devices"])
    with open(RECORDED / "SOURCES.md", "a") as sources:
        sources.write(f"- `{sample}.burnin.json`: `check --burn-in 20`, recorded "
                      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {socket.gethostname()} "
                      f"by tests/gpu/test_gpu.py, torch {node['torch']}: {figures}\n")
    print(f"burn-in 20 s: {figures}")


def lora_through_ftbundle(tmp_path: Path, device: str) -> tuple[subprocess.CompletedProcess, str]:
    """The quickstart's LoRA fine-tune of the tiny model through `ftbundle run`, output piped,
    one rank on ``device`` ("cuda": bf16 and NCCL, as a GPU user runs it; "cpu": the same
    checks on a machine without a GPU). Returns the run and rank 0's node log."""
    import yaml

    from tests.train.test_quickstart import quickstart_copy
    from tests.train.test_ux_run import ftb

    model = helpers.tiny_model()
    if device == "cuda":  # what a GPU user's config says: no use_cpu, no gloo, bf16
        job = quickstart_copy(tmp_path, model, use_cpu=False, bf16=True, max_steps=30)
        train_path = job.parent / "train.yaml"
        train = yaml.safe_load(train_path.read_text())
        del train["ddp_backend"]
        train_path.write_text(yaml.safe_dump(train))
    else:
        job = quickstart_copy(tmp_path, model, max_steps=30)
    spec = yaml.safe_load(job.read_text())
    spec["nproc_per_node"] = 1
    if device == "cuda":
        spec["gpus_per_node"] = "auto"
    spec["env"].pop("GLOO_SOCKET_IFNAME", None)
    if os.environ.get("PYTHONPATH"):  # (.ci/gpu-check.sh: the carried wheels, for the ranks too)
        spec["env"]["PYTHONPATH"] = os.environ["PYTHONPATH"]
    job.write_text(yaml.safe_dump(spec))
    proc = ftb("run", str(job))
    logs = sorted((job.parent / ".shared/runs").glob("*/node-0-*.log"))
    return proc, (logs[-1].read_text(errors="replace") if logs else "")


def assert_the_ranks_step_clock_ran(job_dir: Path, steps: int) -> None:
    """The run's summary.json has the rank's own step times (shims/steptimes.py: CUDA events on
    a GPU, the CPU's clock elsewhere): every step timed (on a GPU the last ones, still on it when
    training ended, waited for then), each below what a whole step took."""
    import json

    (summary,) = (job_dir / "quickstart/.shared/runs").glob("*/summary.json")
    record = json.loads(summary.read_text())
    (node,) = record["step_times"]["nodes"].values()
    assert node["steps"] == steps and 0 < node["median_s"] <= node["p90_s"], record["step_times"]
    assert node["median_s"] < record["duration_s"] / steps, (node, record["duration_s"])
    print(f"step clock: {node['steps']} steps, median {node['median_s'] * 1000:.1f} ms, "
          f"p90 {node['p90_s'] * 1000:.1f} ms")


def step_clock_against_the_wall(tmp_path: Path, device: str, size: int) -> tuple[list[float], list[float]]:
    """The step clock on a plain model of 4 square layers, 25 steps: its times, and each step's
    forward and backward timed from outside with the device synchronized before and after."""
    import time

    import torch

    from ftbundle.shims.steptimes import StepClock

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = torch.nn.Sequential(*[torch.nn.Linear(size, size, bias=False) for _ in range(4)]).to(device, dtype)
    x = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock = StepClock(path=str(tmp_path / "steps"), local_rank="0")
    clock.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    walls = []
    for _ in range(25):
        sync()
        began = time.perf_counter()
        clock.step_begins()
        model(x).float().square().mean().backward()
        sync()
        walls.append(time.perf_counter() - began)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_done()
    clock.finish()  # (the steps the GPU had not passed at their end are waited for)
    assert (tmp_path / "steps.0").read_text().split()[:2] == ["0", "25"]
    return clock.times, walls


def assert_what_the_first_gpu_run_showed_is_gone(proc: subprocess.CompletedProcess, log: str, device: str) -> None:
    """What ../shared/gpu/RUN-2026-11-27.md saw on the terminal of a real H100 run (issue 37
    item 5): the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE warning, raw tqdm fragments, and 32 s
    before the first step with nothing saying where they went."""
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert f"device: {device}" in log, log[-3000:]  # LlamaFactory's own line: the rank ran where asked
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in out + log, [line for line in (out + log).splitlines()
                                                             if "TRACE_BUFFER" in line]
    raw_bars = [line for line in out.splitlines() if re.search(r"\d+%\|", line) or "Running tokenizer" in line]
    assert not raw_bars, raw_bars
    assert re.search(r"\d+%\|", log), log[-2000:]  # (tqdm did draw its bars: into the log, not the terminal)
    where = [line for line in out.splitlines() if line.startswith("ftbundle: before the first step ")]
    assert where and "imports (torch, transformers, LlamaFactory) " in where[0], out
    progress = [line for line in out.splitlines() if line.startswith("ftbundle: training: step")]
    assert progress and progress[-1].split()[3] == "30/30", out
    print(where[0])
    print(progress[-1])


@pytest.mark.gpu
def test_lora_on_the_gpu_shows_no_deprecated_variable_no_raw_bar_and_where_the_time_went(tmp_path):
    """Issue 37 item 5: the quickstart's LoRA on this machine's GPU (bf16, NCCL), one rank; and
    the rank's step clock (CUDA events, item 3) reached the summary."""
    proc, log = lora_through_ftbundle(tmp_path, "cuda")
    assert_what_the_first_gpu_run_showed_is_gone(proc, log, "cuda")
    assert_the_ranks_step_clock_ran(tmp_path, 30)
    assert_tokens_and_mfu_agree_with_a_hand_count(tmp_path, proc)


def model_params(model: Path) -> int:
    """The tiny model's parameters, counted by hand from its safetensors headers."""
    import json

    total = 0
    for weights in model.glob("*.safetensors"):
        with open(weights, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for d in tensor["shape"]:
                    count *= d
                total += count
    return total


def assert_tokens_and_mfu_agree_with_a_hand_count(job_dir: Path, proc: subprocess.CompletedProcess) -> None:
    """Issue 47 item 5: the LoRA's tokens/s against the trainer's own count over its runtime, and
    its MFU against 6 x the model's parameters x tokens/s / this GPU's dense bf16 peak (ftbundle's
    table, by nvidia-smi's name); recorded in tests/data/nvidia-smi/recorded/ with the date."""
    import json

    from ftbundle.speed import gpu_peak

    (summary_path,) = (job_dir / "quickstart/.shared/runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    runtime = json.loads((job_dir / "quickstart/.shared/output/quickstart-lora/train_results.json").read_text())
    assert summary["tokens"] and summary["tokens_per_s"] == pytest.approx(
        summary["tokens"] / runtime["train_runtime"], rel=0.25), (summary, runtime)
    assert summary["tokens_per_s_per_rank"] == pytest.approx(summary["tokens_per_s"], abs=0.1)  # (one GPU)
    listing, sample = listed_gpus()
    name = listing.split(": ", 1)[1].split(" (UUID")[0]
    params = model_params(helpers.tiny_model())
    found = gpu_peak(name)
    if found is None:  # (a GPU the table does not know: said, not guessed)
        assert summary["mfu"] is None and summary["mfu_basis"].startswith("MFU unknown"), summary
    else:
        by_hand = 6 * params * summary["tokens_per_s"] / (found[1] * 1e12)
        assert summary["mfu"] == pytest.approx(by_hand, rel=2e-3), (summary, by_hand)
        assert f"over 1 x {found[0]} at {found[1]:g} TFLOP/s" in summary["mfu_basis"], summary["mfu_basis"]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("  MFU          ")] or [""]
    assert line, proc.stdout[-3000:]
    figures = {"recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "host": socket.gethostname(), "gpu": name, "params": params, "tokens": summary["tokens"],
               "tokens_per_s": summary["tokens_per_s"], "train_runtime": runtime["train_runtime"],
               "mfu": summary["mfu"], "mfu_basis": summary["mfu_basis"], "summary_line": line.strip()}
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.lora-speed.json").write_text(json.dumps(figures, indent=2) + "\n")
    with open(RECORDED / "SOURCES.md", "a") as sources:
        sources.write(f"- `{sample}.lora-speed.json`: the quickstart LoRA (30 steps, bf16, 1 GPU) through `ftbundle run`, "
                      f"recorded {figures['recorded']} on {figures['host']} by tests/gpu/test_gpu.py: "
                      f"{summary['tokens_per_s']:,} tokens/s, MFU {summary['mfu']}\n")
    print(f"LoRA speed: {line.strip()}")


@pytest.mark.gpu
def test_a_plain_loops_mfu_is_6_x_its_parameters_x_tokens_over_the_peak(tmp_path):
    """A script's own loop on the GPU (StepClock: CUDA events, the model's parameters counted on the
    device, tokens per step): ftbundle's MFU against a hand count from the GPU's synchronized wall
    time. 4 bf16 layers of 8192 without bias, 8192 rows a step taken as its tokens: 6 x 268M
    parameters x tokens is the usual count (the first layer's input gradient is not computed: the
    GEMMs really done are 5.5/6 of it), so the MFU lies below what the burn-in's GEMM allows."""
    import json
    import time

    import torch

    from ftbundle.shims.steptimes import StepClock
    from ftbundle.speed import SpeedBasis, gpu_peak
    from ftbundle.ui.progress import Progress

    listing, sample = listed_gpus()
    name = listing.split(": ", 1)[1].split(" (UUID")[0]
    found = gpu_peak(name)
    if found is None:
        pytest.skip(f"{name}: not in ftbundle's table (the burn-in's GEMM stands in there: check_burnin)")
    size, rows = 8192, 8192
    model = torch.nn.Sequential(*[torch.nn.Linear(size, size, bias=False) for _ in range(4)]).to("cuda", torch.bfloat16)
    x = torch.randn(rows, size, device="cuda", dtype=torch.bfloat16)
    clock = StepClock(path=str(tmp_path / "steps"), local_rank="0")
    clock.watch(model)
    assert clock.params == 4 * size * size
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    began = None
    for step in range(40):  # (no sync in the loop, as in a real one: the host queues far ahead)
        clock.step_begins()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_done(tokens=rows)
        if step == 0:  # (the wall from the first step's end, as the clock counts: cuBLAS's start-up apart)
            torch.cuda.synchronize()
            began = time.perf_counter()
    torch.cuda.synchronize()
    wall = time.perf_counter() - began
    clock.finish()
    line = (tmp_path / "steps.0").read_text().strip()
    p = Progress(speed=SpeedBasis(ranks=1, gpus=1, gpu=found[0], peak_tflops=found[1]))
    p.feed_steps("localhost", line, now=time.monotonic())
    assert p.speed.params == 4 * size * size
    by_hand = 6 * 4 * size * size * (39 * rows / wall) / (found[1] * 1e12)  # (39 steps after the first)
    mfu = p.mfu()
    print(f"plain loop on {name}: MFU {mfu:.1%} (by the synchronized wall {by_hand:.1%}), {p.tokens_per_s():,.0f} tokens/s")
    assert 0.1 < mfu < 1.0 and mfu == pytest.approx(by_hand, rel=0.15), (mfu, by_hand, line)
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.loop-mfu.json").write_text(json.dumps({
        "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": name, "line": line, "mfu": mfu, "mfu_by_wall": by_hand, "wall_s": wall}, indent=2) + "\n")


@pytest.mark.gpu
def test_the_step_clock_times_the_gpus_work_not_the_kernel_launches(tmp_path):
    """The straggler figure on a GPU (shims/steptimes.py, item 3) is CUDA events around each
    micro-batch, read once the GPU has passed them. Launching a step's kernels takes the CPU a
    hundredth of what running them takes the GPU, so a clock that timed the launches would name
    no slow GPU: its median must be close to each step's forward and backward timed from outside
    with the GPU synchronized (4 bf16 layers of 8192: 12 GEMMs a step, about 20 ms on an H100)."""
    times, walls = step_clock_against_the_wall(tmp_path, "cuda", 8192)
    ratio = sorted(times)[len(times) // 2] / sorted(walls)[len(walls) // 2]
    print(f"step clock on the GPU: median {sorted(times)[12] * 1000:.2f} ms, synchronized wall "
          f"{sorted(walls)[12] * 1000:.2f} ms ({ratio:.2f}x), {len(times)} steps")
    assert len(times) == 25 and 0.7 < ratio <= 1.05, (times, walls)


@pytest.mark.gpu
def test_the_node_programs_kernel_log_read_names_this_machines_gpus(tmp_path):
    """node.sh's ``xids`` (what a failed or stalled run reads on every `ftb-gpu` node) against the
    real driver: the kernel's uptime, nvidia-smi's index/UUID/PCI CSV lined up with
    `nvidia-smi -L`, the Xid lines parsed with their age; with SINCE in the future, nothing at all
    (no Xid after the attempt began: the launcher names none). Within its time limit."""
    import time

    from ftbundle.gpu_health import parse_xids_report

    node = Path(__file__).resolve().parents[2] / "ftbundle" / "remote" / "node.sh"
    t = time.monotonic()
    proc = subprocess.run(["bash", str(node), "xids", "3600"], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t
    assert proc.returncode == 0 and took < 4, (proc.returncode, took, proc.stdout, proc.stderr)
    uptime = [line for line in proc.stdout.splitlines() if line.startswith("uptime ")]
    assert uptime and float(uptime[0].split()[1]) > 0, proc.stdout
    gpus, xids = parse_xids_report(proc.stdout)
    listing, sample = listed_gpus()
    assert [g.uuid for g in gpus] == re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", listing), proc.stdout
    assert all(g.bus_id for g in gpus) and all(x.age_s is not None for x in xids), proc.stdout
    later = subprocess.run(["bash", str(node), "xids", "3600", str(int(float(uptime[0].split()[1])) + 3600)],
                           capture_output=True, text=True, timeout=30)
    assert later.returncode == 0 and later.stdout == "", later.stdout
    dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).returncode
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.xids.txt").write_text(proc.stdout)
    with open(RECORDED / "SOURCES.md", "a") as sources:
        sources.write(f"- `{sample}.xids.txt`: `node.sh xids 3600` (a failed run's kernel-log read), recorded "
                      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {socket.gethostname()} "
                      f"by tests/gpu/test_gpu.py in {took:.2f} s; dmesg exit {dmesg}; {len(xids)} Xid lines\n")
    print(f"node.sh xids: {took:.2f} s, {len(gpus)} GPUs, {len(xids)} Xid lines, dmesg exit {dmesg}")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_healthy_gpu_under_a_burn_ins_load_is_named_by_no_health_rule(tmp_path):
    """The health query, as the probe asks it, every 0.5 s while the burn-in loads this machine's
    GPUs: under full load (power at its cap, clocks moving, the link busy) a healthy GPU must not
    be named (clocks cut, a slow PCIe link, anything fatal): a check run beside a busy job, or a
    rule that only holds at idle, would otherwise name a good GPU. The readings are recorded
    (`<sample>.under-load.health.csv`, replayed by tests/unit/test_check_health_unit.py) with what they
    show: the clock event reasons seen, the SM clock and the power draw."""
    from ftbundle import gpu_health as H

    fields = ",".join(H.FIELD_ALIASES.get(f, f) for f in H.HEALTH_FIELDS)  # (this driver's name for the reasons)
    samples = tmp_path / "under-load.csv"
    with open(samples, "w") as out:
        sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,nounits", "-lms", "500"],
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            report = burn_in_here(tmp_path, 20)
        finally:
            sampler.terminate()
            sampler.wait(timeout=30)
    assert report.ok, report.errors
    lines = samples.read_text().splitlines()
    text = "\n".join([lines[0], *(line for line in lines[1:] if not line.startswith("index"))]) + "\n"
    readings = H.parse_health_csv(text)
    busy = [g for g in readings if not (g.clock_events or 0) & H.IDLE_REASON]
    assert len(busy) >= 20, text[:2000]  # the load was seen (20 s at 2 readings a second, all GPUs)
    named = [f"{f.gpu}: {f.reading}" for g in readings for f in H.gpu_findings("here", g)]
    _, sample = listed_gpus()
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.under-load.health.csv").write_text(text)
    reasons = sorted({g.clock_events or 0 for g in readings})
    clocks = sorted(g.sm_clock_mhz for g in busy if g.sm_clock_mhz is not None)
    column = [re.sub(r"\s*\[.*\]$", "", c) for c in lines[0].split(", ")].index("power.draw")
    power = [float(cells[column]) for cells in (line.split(", ") for line in text.splitlines()[1:])
             if len(cells) > column and re.fullmatch(r"[0-9.]+", cells[column])]
    seen = (f"{len(readings)} readings, {len(busy)} busy; clock event reasons seen "
            f"{', '.join(f'{r:#x}' for r in reasons)}; busy SM clock {clocks[0]}-{clocks[-1]} MHz "
            f"(median {clocks[len(clocks) // 2]}); power draw up to {max(power, default=0):.0f} W; "
            f"burn-in {'; '.join(f'{f.device} {f.metric} {f.value:.0f}' for f in report.figures)}")
    with open(RECORDED / "SOURCES.md", "a") as sources:
        sources.write(f"- `{sample}.under-load.health.csv`: the probe's health query every 0.5 s during "
                      f"`check --burn-in 20`, recorded {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
                      f"on {socket.gethostname()} by tests/gpu/test_gpu.py: {seen}; named: {'; '.join(named) or 'nothing'}\n")
    print(f"under load: {seen}")
    assert not named, named


@pytest.mark.gpu
def test_the_run_samplers_query_reads_a_real_gpu(tmp_path):
    """The run's GPU sampler's query (ftbundle/gpu_metrics.py QUERY) on the real driver: three
    readings 500 ms apart from one `nvidia-smi -lms` loop (the node's own), each GPU's fields
    parsed (no field unknown to the driver: clocks_throttle_reasons.active is still accepted where
    the driver prints clocks_event_reasons); recorded as <gpu>.metrics.csv beside the others."""
    from ftbundle.gpu_metrics import QUERY, parse_line

    listing, sample = listed_gpus()
    count = listing.count("GPU ")
    proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "500"],
                            stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        while len(lines) < 3 * count:
            line = proc.stdout.readline()
            assert line, lines
            lines.append(line.rstrip("\n"))
    finally:
        proc.kill()
    readings = [lines[i:i + count] for i in range(0, len(lines), count)]
    for reading in readings:
        parsed = parse_line("\n".join(reading))
        assert len(parsed) == count, reading
        assert all(r.util is not None and r.mem_total_mib and r.reasons is not None for r in parsed), reading
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{sample}.metrics.csv").write_text("\n".join("\n".join(r) + "\n" for r in readings))
