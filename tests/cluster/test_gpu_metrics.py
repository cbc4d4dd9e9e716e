"""Live GPU metrics from every host (issue 47 item 2) on containerized SSH hosts: real sshd, real
torchrun, and on each host the nvidia-smi stand-in replaying readings (tests/data/nvidia-smi:
a busy 8-GPU H100 fleet, one host idle, one GPU near its memory).

While the run goes, the idle host and the full GPU are named on the right host and GPU, and
`ftbundle status` shows every host's GPUs and the same two; the summary, summary.json, `runs`,
`runs --json` and metrics.jsonl (for `plot`) carry each node's mean utilization and peak memory.
A CPU job on the same hosts reads no GPU at all (nvidia-smi is never asked while it runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.support.helpers import REPO, base_job, ftbundle, install_smi, only_run_dir, write_job

pytestmark = pytest.mark.cluster

HOLD = """\
import os, time
import torch.distributed as dist

dist.init_process_group("gloo")
time.sleep(float(os.environ["HOLD_S"]))
dist.barrier()
dist.destroy_process_group()
"""

SAMPLES = {"node0": "h100-x8", "node1": "h100-x8-idle", "node2": "h100-x8-near-memory"}


def run_until_said(job, env: dict, words: str):
    """`ftbundle run JOB` until its stderr has ``words``, then `ftbundle status JOB` while it
    runs, then its end: (exit code, [(when, stderr line)], stdout, the status)."""
    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", str(job)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: err.extend((time.monotonic(), line) for line in proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(words in line for _, line in err):
            assert proc.poll() is None, "".join(line for _, line in err)
            assert time.monotonic() < deadline, "".join(line for _, line in err)
            time.sleep(0.5)
        status = ftbundle("status", str(job), timeout=60)
        out = proc.stdout.read()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    reader.join(5)
    return code, err, out, status


def test_an_idle_host_and_a_full_gpu_are_named_while_the_run_goes(make_cluster, tmp_path):
    cluster = make_cluster(3)
    shared = cluster.shared_dir
    for host, metrics in SAMPLES.items():
        install_smi(cluster, host, "h100-x8", metrics)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "hold.py").write_text(HOLD)
    job = write_job(tmp_path / "job.yaml", base_job("gpus", shared, inventory, {"script": "hold.py"},
                                                    workdir=str(shared),
                                                    env={**base_job("x", shared, inventory, {})["env"], "HOLD_S": "45"}))
    env = {**os.environ, "FTB_GPU_SAMPLE_S": "1"}  # (a reading a second: the 30 s window fills within the run)
    code, err, out, status = run_until_said(job, env, "node1's GPUs idle")
    said = "".join(line for _, line in err)
    assert code == 0, said + out

    # named while it ran: the idle host (no step clock in a script: said so), the full GPU
    ended = next(at for at, line in err if "finished run" in line) if any("finished run" in line for _, line in err) \
        else time.monotonic()
    warned = [(at, line) for at, line in err if line.startswith("ftbundle: warning: ")]
    idle = [(at, line) for at, line in warned if "node1's GPUs idle well below the fleet's" in line]
    full = [(at, line) for at, line in warned if "node2 GPU 1 holds" in line and "out-of-memory risk" in line]
    assert len(idle) == 1 and len(full) == 1, said
    assert idle[0][0] < ended and full[0][0] < ended
    assert "no step times to tell whether it is input-bound or waiting" in idle[0][1]
    assert not any(h in line for _, line in err for h in ("node0's GPUs", "node2's GPUs", "node0 GPU", "throttled"))

    # status, read while the run went: every host's GPUs, the idle one and the full GPU
    assert status is not None and status.returncode == 0, status.stdout + status.stderr
    rows = [line for line in status.stdout.splitlines() if line.startswith("  gpu  ")]
    assert len(rows) == 24 and {line.split()[1] for line in rows} == {"node0", "node1", "node2"}, status.stdout
    assert "idle: node1's GPUs" in status.stdout and "memory: node2 GPU 1 holds" in status.stdout, status.stdout

    # the summary, summary.json, runs and runs --json, metrics.jsonl
    everything = said + out
    assert "GPUs         node1 " in everything and "named        node1's GPUs idle" in everything, everything
    run = only_run_dir(shared)
    record = json.loads((run / "summary.json").read_text())["gpus"]
    nodes = record["nodes"]
    assert set(nodes) == {"node0", "node1", "node2"} and all(n["gpus"] == 8 for n in nodes.values())
    assert nodes["node1"]["util_mean"] < 10 and nodes["node0"]["util_mean"] > 88, nodes
    assert nodes["node2"]["mem_peak_mib"] >= 78400 and nodes["node0"]["mem_peak_mib"] < 63000, nodes
    assert len(record["named"]) == 2
    runs = ftbundle("runs", str(job), timeout=60)
    assert runs.returncode == 0 and " GPU " in runs.stdout.splitlines()[0], runs.stdout
    assert "77/80G" in runs.stdout, runs.stdout  # (the fleet's mean utilization, the fullest GPU's peak)
    as_json = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
    assert as_json[-1]["gpus"]["nodes"]["node2"]["mem_peak_mib"] == nodes["node2"]["mem_peak_mib"]
    curve = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in curve if "gpu_util" in r]) >= 3, curve
    png = tmp_path / "gpus.png"
    plotted = ftbundle("plot", str(job), "-o", str(png), timeout=120)
    assert plotted.returncode == 0 and png.stat().st_size > 0, plotted.stdout + plotted.stderr

    # a CPU job on the same hosts: nvidia-smi never asked while it runs, nothing of GPUs said or kept
    for host in SAMPLES:
        cluster.exec(host, "rm -f /etc/ftb-smi/calls")
    cpu = write_job(tmp_path / "cpu.yaml", base_job("cpu", shared, inventory, {"script": "hold.py"}, workdir=str(shared),
                                                    gpus_per_node=0,
                                                    env={**base_job("x", shared, inventory, {})["env"], "HOLD_S": "4"}))
    done = ftbundle("run", str(cpu), "--no-check", timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GPU" not in done.stdout + done.stderr
    cpu_run = next(p for p in (shared / "runs").iterdir() if p.name.startswith("cpu-"))
    assert json.loads((cpu_run / "summary.json").read_text())["gpus"] is None
    asked = "".join(cluster.exec(h, "cat /etc/ftb-smi/calls 2>/dev/null || true").stdout for h in SAMPLES)
    assert "utilization.gpu" not in asked, asked


def test_a_host_whose_nvidia_smi_hangs_is_named_and_its_hung_reader_goes_with_the_job(make_cluster, tmp_path):
    """node1's nvidia-smi hangs after three readings, as it does when a GPU stops responding (the
    stand-in's hang-after: then every query hangs): while the run goes its readings are named as
    stopped, once, on node1 alone, with node0 read on as before; `status` says node1 gave no
    reading; the job is not failed for it; nothing of the hung nvidia-smi is left on node1."""
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    for host in ("node0", "node1"):
        install_smi(cluster, host, "h100-x8")
    cluster.exec("node1", "echo 3 > /etc/ftb-smi/hang-after")
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "hold.py").write_text(HOLD)
    job = write_job(tmp_path / "job.yaml", base_job("gpus-hang", shared, inventory, {"script": "hold.py"},
                                                    workdir=str(shared),
                                                    env={**base_job("x", shared, inventory, {})["env"], "HOLD_S": "25"}))
    env = {**os.environ, "FTB_GPU_SAMPLE_S": "0.5"}  # (silent after 10 beats: 10 readings' time is 5 s)
    code, err, out, status = run_until_said(job, env, "GPU readings stopped")
    said = "".join(line for _, line in err)
    assert code == 0, said + out
    stopped = [line for _, line in err if "GPU readings stopped" in line and not line.startswith("  named ")]
    assert len(stopped) == 1 and stopped[0].startswith("ftbundle: warning: node1's GPU readings stopped: none in its "
                                                       "last 10 heartbeats (10s) while the node itself answers"), said
    assert "node0's GPU readings" not in said and "has sent no GPU reading" not in said, said
    rows = [line for line in status.stdout.splitlines() if line.startswith("  gpu  ")]
    assert sum(line.split()[1] == "node0" for line in rows) == 8, status.stdout
    assert [line for line in rows if line.split()[1] == "node1"] == [
        "  gpu  node1                no reading: nvidia-smi gave none within 2s (a GPU that stops responding or a "
        "wedged driver hangs it)"], status.stdout
    record = json.loads((only_run_dir(shared) / "summary.json").read_text())["gpus"]
    assert any(n.startswith("node1's GPU readings stopped") for n in record["named"]), record
    assert record["nodes"]["node1"]["readings"] == 3 and record["nodes"]["node0"]["readings"] > 20, record
    assert "GPUs         node1 " in out + said and "(8 GPU(s), over 3 readings only (" in out + said, out + said
    assert cluster.exec("node1", "test -e /etc/ftb-smi/hung && echo hung").stdout.strip() == "hung"
    assert not cluster.exec("node1", "pgrep -af '[s]leep 3600' || true").stdout.strip()  # (gone with the job)


def test_a_detached_runs_gpus_are_kept_by_each_nodes_watcher(make_cluster, tmp_path):
    """No launcher stays: each node's watcher reads its GPUs (one nvidia-smi loop) and keeps its
    mean utilization and peak memory beside its files; `status` shows the GPUs while it runs and
    `runs --json` carries each node's figures once it is over."""
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    install_smi(cluster, "node0", "h100-x8", "h100-x8-near-memory")
    install_smi(cluster, "node1", "h100-x8", "h100-x8-idle")
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "hold.py").write_text(HOLD)
    job = write_job(tmp_path / "job.yaml", base_job("gpus-detached", shared, inventory, {"script": "hold.py"},
                                                    workdir=str(shared),
                                                    env={**base_job("x", shared, inventory, {})["env"], "HOLD_S": "15"}))
    env = {**os.environ, "FTB_GPU_SAMPLE_S": "1"}
    started = ftbundle("run", "--detach", str(job), timeout=180, env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    time.sleep(6)
    status = ftbundle("status", str(job), timeout=60)
    assert sum(1 for line in status.stdout.splitlines() if line.startswith("  gpu  ")) == 16, status.stdout
    assert "memory: node0 GPU 1 holds" in status.stdout, status.stdout
    deadline = time.monotonic() + 120
    while True:
        rows = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
        if rows[-1]["state"] == "finished" and rows[-1]["gpus"] and len(rows[-1]["gpus"]["nodes"]) == 2:
            break
        assert time.monotonic() < deadline, rows[-1]
        time.sleep(2)
    nodes = rows[-1]["gpus"]["nodes"]
    assert nodes["node1"]["util_mean"] < 10 and nodes["node0"]["util_mean"] > 88, nodes
    assert nodes["node0"]["mem_peak_mib"] >= 78400 and nodes["node0"]["gpus"] == 8 and nodes["node0"]["readings"] >= 5
    run = only_run_dir(shared)
    assert not cluster.exec("node0", "pgrep -f '[u]tilization.gpu' || true").stdout.strip()  # (its loop went with the job)
    assert (run / "node-0.a1.gpumetrics").exists()


def test_gpus_the_table_does_not_know_are_counted_against_the_gemm_a_burn_in_kept(make_cluster, tmp_path):
    """MFU's peak where ftbundle's table has no data sheet for the GPUs (AWS's A10G here: the
    recorded H100 readings renamed, each host's GPUs UUIDs of their own): rank 0's probe reads,
    over real SSH on shared storage, the bf16 GEMM the newest burn-in kept
    (<shared_dir>/checks/gemm.json, as check/burnin.py writes it from each node's figures), and
    the run counts against the median of its own GPUs' figures, said in plan.json. (The burn-in's
    GPU half needs a GPU: tests/gpu; a CPU burn-in keeps no GEMM: tests/unit/test_speed_unit.py.)"""
    from ftbundle.check.burnin import BurninReport, compare, figures_of, gemm_record

    cluster = make_cluster(2)
    shared = cluster.shared_dir
    uuids = {}
    for i, host in enumerate(("node0", "node1")):
        install_smi(cluster, host, "h100-x8")
        cluster.exec(host, "cd /etc/ftb-smi && for f in h100-x8.*; do sed -e 's/NVIDIA H100 80GB HBM3/NVIDIA A10G/' "
                           f"-e 's/GPU-5c1e8a2/GPU-{i}a10a2/' $f > a10g-x8.${{f#h100-x8.}}; done && echo a10g-x8 > sample")
        uuids[host] = [line.split(", ")[1] for line in
                       cluster.exec(host, "nvidia-smi --query-gpu=index,uuid,memory.used").stdout.splitlines()]
    assert len(uuids["node0"]) == 8 and not set(uuids["node0"]) & set(uuids["node1"]), uuids
    # what a burn-in of node0 alone kept: each of its GPUs' bf16 GEMM (60-67 TFLOP/s), from the node
    # results it read (shims/burnin.py's JSON)
    node = {"devices": [{"device": f"GPU {k}", "name": "NVIDIA A10G", "uuid": u, "gemm_bf16_tflops": 60.0 + k,
                         "hbm_copy_gbps": 500.0} for k, u in enumerate(uuids["node0"])]}
    figures, _ = figures_of("node0", node)
    report = BurninReport(check_dir=f"{shared}/checks/burn-x", figures=figures, nodes={"node0": node})
    report.medians, report.slow = compare(figures)
    (shared / "checks").mkdir()
    (shared / "checks" / "gemm.json").write_text(json.dumps(gemm_record(report, "burn-x", time.time())))

    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "nothing.py").write_text("pass\n")
    job = write_job(tmp_path / "job.yaml", base_job("unknown-gpus", shared, inventory, {"script": "nothing.py"},
                                                    workdir=str(shared)))
    # `check` of a LlamaFactory job on these hosts says it before any run, as `run` would before it
    # starts (its model: a safetensors header of 3 x 10^6 parameters, all a check reads of it)
    (shared / "model").mkdir()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1000, 3000], "data_offsets": [0, 6_000_000]}}).encode()
    (shared / "model" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (shared / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1000}))
    (shared / "data").mkdir()
    (shared / "data" / "dataset_info.json").write_text(json.dumps({"support": {"file_name": "support.json"}}))
    (shared / "data" / "support.json").write_text(json.dumps([{"instruction": "hi", "input": "", "output": "ok"}]))
    lf = {"llamafactory": {"model_name_or_path": str(shared / "model"), "dataset": "support", "dataset_dir": "data",
                           "output_dir": "out", "save_total_limit": 1}}
    lf_job = write_job(tmp_path / "lf.yaml", base_job("unknown-gpus-lf", shared, inventory, lf, workdir=str(shared)))
    checked = ftbundle("check", str(lf_job), timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    said = checked.stdout.split("before it starts, `ftbundle run` would say:\n", 1)[-1].splitlines()
    assert "  MFU counted against 60 TFLOP/s, the median bf16 GEMM the burn-in burn-x measured on " in "\n".join(said) \
        and said[-1].endswith(" on 1 of these 2 GPUs (NVIDIA A10G has no data-sheet peak in ftbundle's table)"), \
        checked.stdout
    done = ftbundle("run", str(job), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    speed = json.loads((only_run_dir(shared) / "plan.json").read_text())["speed"]
    # a rank a host, on its GPU 0: node0's measured 60.0, node1's not measured (the median of what was)
    assert (speed["gpu"], speed["gpus"], speed["peak_tflops"]) == ("NVIDIA A10G", 2, 60.0), speed
    assert speed["peak_from"].startswith("the median bf16 GEMM the burn-in burn-x measured on ") and \
        speed["peak_from"].endswith(" on 1 of these 2 GPUs (NVIDIA A10G has no data-sheet peak in ftbundle's table)"), speed

    # a later burn-in of node1 alone: the launcher reads the record kept before over SSH on rank
    # 0's host (check/burnin.py _kept_gemm) and keeps node0's figures beside node1's new ones
    from ftbundle.check.burnin import _kept_gemm
    from ftbundle.commands.common import load_layout, open_cluster

    later = {"devices": [{"device": f"GPU {k}", "name": "NVIDIA A10G", "uuid": u, "gemm_bf16_tflops": 50.0,
                          "hbm_copy_gbps": 500.0} for k, u in enumerate(uuids["node1"])]}
    figures, _ = figures_of("node1", later)
    report1 = BurninReport(check_dir=f"{shared}/checks/burn-y", figures=figures, nodes={"node1": later})
    record = f"{shared}/checks/gemm.json"
    _, layout = load_layout(str(job), None)
    with open_cluster(layout.hosts) as ssh:
        rank0 = layout.hosts[0]
        kept = _kept_gemm(ssh, rank0, record, report1)
        merged = gemm_record(report1, "burn-y", time.time(), kept)
        assert set(merged["gpus"]) == set(uuids["node0"]) | set(uuids["node1"]) and not report1.notes
        assert {g["check"] for u, g in merged["gpus"].items() if u in uuids["node0"]} == {"burn-x"}
        assert {g["tflops"] for u, g in merged["gpus"].items() if u in uuids["node1"]} == {50.0}
        # none there yet: nothing to keep, nothing said; one that is not JSON: said, replaced
        assert _kept_gemm(ssh, rank0, f"{shared}/checks/none.json", report1) is None and not report1.notes
        (shared / "checks" / "gemm.json").write_text("{\"gpus\": {")
        assert _kept_gemm(ssh, rank0, record, report1) is None
        assert report1.notes and report1.notes[0].startswith(f"{record} could not be read (not JSON ("), report1.notes
