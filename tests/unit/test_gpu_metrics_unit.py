"""The GPUs while a run goes (issue 47 item 2, ftbundle/gpu_metrics.py): the real node program's
sampler with the nvidia-smi stand-in replaying readings (one process for the run, none for a CPU
job), and the fleet's rules on readings: who is named, when, and that a healthy busy fleet of 256
hosts (the recorded H100 at its power cap among them) names nobody. No containers."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ftbundle import gpu_metrics, protocol
from ftbundle.gpu_metrics import GpuFleet, parse_line, runs_cell, status_lines, summary_lines
from ftbundle.launch.node import program
from ftbundle.ui.progress import Progress, status_line
from ftbundle.ui.stragglers import NodeSteps, idle_cause

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "data" / "nvidia-smi"
REPLAY = ROOT / "tests" / "assets" / "nvidia-smi-replay"
RECORDED = SMI / "h100-under-load-recorded.metrics.csv"


def readings_of(path: Path) -> list[str]:
    """A metrics sample's readings, each as the node sends it (its GPUs joined by ';')."""
    return [";".join(block.strip().splitlines()) for block in path.read_text().split("\n\n") if block.strip()]


# -- the node program's sampler, for real ------------------------------------------------------

def run_node(tmp_path: Path, every_ms: int, ids: str = "", seconds: float = 2.0, *, beat_s: float = 0.5,
             hang_after: int | None = None) -> tuple[list[bytes], Path]:
    """The real node program running `sleep` on a host whose nvidia-smi is the stand-in replaying
    the busy 8-GPU sample (with ``hang_after``: that many readings, then hung, as on a GPU that
    stopped responding); its stderr lines and the stand-in's folder (its `calls`)."""
    bin_dir, smi = tmp_path / "bin", tmp_path / "smi"
    bin_dir.mkdir()
    smi.mkdir()
    shutil.copy(REPLAY, bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    shutil.copy(SMI / "h100-x8.metrics.csv", smi)
    (smi / "sample").write_text("h100-x8\n")
    if hang_after is not None:
        (smi / "hang-after").write_text(f"{hang_after}\n")
    env = {"FTB_RUN_DIR": str(tmp_path), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(tmp_path / "job.log"),
           "FTB_EXIT": str(tmp_path / "node.exit"), "FTB_PIDFILE": str(tmp_path / "node.pid"),
           "FTB_STOPPED_FILE": str(tmp_path / "node.stopped"), "FTB_MARKER": f"ftb-test-gpus-{time.time_ns()}",
           "FTB_ATTEMPT": "1", "FTB_WATCHDOG": "30", "FTB_HEARTBEAT": str(beat_s), "FTB_STOP_GRACE": "1",
           "FTB_DETACH": "0", "FTB_SHARED_DIR": str(tmp_path), "FTB_GPU_EVERY_MS": str(every_ms),
           "FTB_GPU_FIELDS": gpu_metrics.QUERY, "FTB_GPU_IDS": ids}
    proc = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sleep", str(seconds)],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "FTB_SMI_DIR": str(smi)})
    raw: list[bytes] = []
    reader = threading.Thread(target=lambda: raw.extend(line.rstrip(b"\n") for line in proc.stderr), daemon=True)
    reader.start()
    proc.stdin.write(protocol.env_payload(env))
    proc.stdin.flush()
    try:
        assert proc.wait(timeout=30) == 0, raw
    finally:
        proc.kill()
        proc.stdin.close()
    reader.join(5)
    return raw, smi


def still_running(marker: str) -> list[str]:
    """Processes whose command line holds ``marker`` (the stand-in's folder)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(f"{pid}: {cmdline}")
    return found


def test_the_node_program_sends_its_gpus_readings_from_one_nvidia_smi_loop(tmp_path):
    raw, smi = run_node(tmp_path, every_ms=300, ids="0,1", seconds=2.5)
    lines = [protocol.parse_line(line) for line in raw]
    readings = [parse_line(line.text) for line in lines if line.kind == protocol.SMI_LINE]
    assert len(readings) >= 4, raw  # about one every 0.3 s over 2.5 s
    assert all([r.index for r in reading] == ["0", "1"] for reading in readings), readings  # the job's GPUs only
    assert protocol.MESSAGE not in {line.kind for line in lines}, raw
    first = readings[0][0]
    assert first.mem_total_mib == 81559 and 90 <= first.util <= 99 and first.reasons in (0, 4)
    # one nvidia-smi for the whole run (-lms), not one a sample; gone when the job is
    calls = [c for c in (smi / "calls").read_text().splitlines() if "utilization.gpu" in c]
    assert len(calls) == 1 and "-lms 300" in calls[0] and "-i 0,1" in calls[0], calls
    deadline = time.monotonic() + 5
    while still_running(str(smi)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not still_running(str(smi))


def with_smi_dir(smi: Path) -> list[str]:
    """Processes whose environment names the stand-in's folder (the node program's, the job's,
    nvidia-smi's, a hung one's `sleep` too)."""
    want = f"FTB_SMI_DIR={smi}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except OSError:
                continue
    return found


def test_a_hung_nvidia_smi_shows_as_heartbeats_without_readings_and_goes_with_the_job(tmp_path):
    """The real node program on a host whose nvidia-smi hangs after two readings (a GPU fallen off
    the bus): its heartbeats go on, no reading comes, and a fleet fed its lines in the order they
    came names that host once, with what it looks like; the hung nvidia-smi ends with the job."""
    raw, smi = run_node(tmp_path, every_ms=200, seconds=4.5, beat_s=0.25, hang_after=2)
    lines = [protocol.parse_line(line) for line in raw]
    kinds = [line.kind for line in lines]
    assert kinds.count(protocol.SMI_LINE) == 2, raw
    last = max(i for i, kind in enumerate(kinds) if kind == protocol.SMI_LINE)
    assert kinds[last:].count(protocol.HB_LINE) >= 12, raw  # (4.5 s of beats every 0.25 s, most after it)
    assert (smi / "hung").exists()
    fleet = GpuFleet(every_s=0.2, beat_s=0.25)
    assert fleet.silent_beats == gpu_metrics.SILENT_BEATS  # (10 readings' time is 2 s: 10 beats is longer)
    said, at = [], 0.0
    for line in lines:
        at += 0.05
        if line.kind == protocol.SMI_LINE:
            fleet.observe("gpu-7", line.text, at)
        elif line.kind == protocol.HB_LINE:
            fleet.beat("gpu-7")
        said += fleet.said(at)  # (looked at after every line)
    assert len(said) == 1 and said[0].startswith("gpu-7's GPU readings stopped: none in its last 10 heartbeats "
                                                 "(2s) while the node itself answers"), said
    assert fleet.live() is None  # (its last reading is not shown as if it were now)
    deadline = time.monotonic() + 5
    while with_smi_dir(smi) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not with_smi_dir(smi)  # (the hung nvidia-smi went with the job: nothing left on the host)


def test_a_cpu_job_reads_no_gpu(tmp_path):
    """FTB_GPU_EVERY_MS 0 (gpus_per_node 0): nothing sampled, no ftb-smi line, nvidia-smi never asked."""
    raw, smi = run_node(tmp_path, every_ms=0, seconds=1.0)
    assert not [line for line in raw if line.startswith(b"ftb-smi")], raw
    assert not (smi / "calls").exists() or "utilization.gpu" not in (smi / "calls").read_text()


# -- the fleet's rules ---------------------------------------------------------------------

BUSY = readings_of(SMI / "h100-x8.metrics.csv")
IDLE = readings_of(SMI / "h100-x8-idle.metrics.csv")
NEAR = readings_of(SMI / "h100-x8-near-memory.metrics.csv")


def feed(fleet: GpuFleet, samples: dict[str, list[str]], seconds: float, *, start: float = 0.0, every: float = 2.0,
         steps: dict | None = None) -> list[str]:
    """Each host's readings in turn (cycled), every ``every`` s for ``seconds``; what was named."""
    said, t, i = [], start, 0
    while t < start + seconds:
        for host, readings in samples.items():
            fleet.observe(host, readings[i % len(readings)], t)
        said += fleet.tick(t, step=i, first_step=start,
                           cause=None if steps is None else (lambda host: idle_cause(host, steps)))
        t += every
        i += 1
    return said


def test_an_idle_host_is_named_once_and_said_input_bound_or_waiting_from_its_step_times():
    fleet = GpuFleet()
    said = feed(fleet, {"node0": BUSY, "node1": IDLE, "node2": BUSY}, 60)
    idle = [s for s in said if "idle" in s]
    assert len(idle) == 1 and idle[0].startswith("node1's GPUs idle well below the fleet's"), said
    assert "no step times to tell" in idle[0]
    # its own steps the slowest: input-bound; its compute the fastest: waiting on the others
    slow = {"node0": NodeSteps("node0", 40, 0.10, 0.11), "node1": NodeSteps("node1", 40, 0.16, 0.17),
            "node2": NodeSteps("node2", 40, 0.10, 0.11)}
    said = feed(GpuFleet(), {"node0": BUSY, "node1": IDLE, "node2": BUSY}, 60, steps=slow)
    assert "looks input-bound" in next(s for s in said if "idle" in s) and "1.60x" in said[0]
    fast = {**slow, "node1": NodeSteps("node1", 40, 0.05, 0.06)}
    said = feed(GpuFleet(), {"node0": BUSY, "node1": IDLE, "node2": BUSY}, 60, steps=fast)
    assert "looks like it waits" in next(s for s in said if "idle" in s)


def test_an_idle_host_is_not_judged_before_the_window_spans_nor_while_the_fleet_itself_idles():
    fleet = GpuFleet()
    assert feed(fleet, {"node0": BUSY, "node1": IDLE, "node2": BUSY}, gpu_metrics.MIN_SPAN_S - 2) == []
    # start-up: every node loading, the fleet idle: nobody is below a busy fleet
    assert feed(GpuFleet(), {"node0": IDLE, "node1": IDLE, "node2": IDLE}, 120) == []
    # readings from before the first step do not count against a node
    fleet = GpuFleet()
    fleet.training_since = 100.0
    for t in range(0, 100, 2):
        fleet.observe("node0", BUSY[0], t)
        fleet.observe("node1", IDLE[0], t)
        fleet.observe("node2", BUSY[0], t)
    assert fleet.said(100.0) == []


def test_a_gpu_near_its_memory_is_named_once_on_its_host_and_index():
    said = feed(GpuFleet(), {"node0": BUSY, "node1": BUSY, "node2": NEAR}, 40)
    near = [s for s in said if "out-of-memory" in s]
    assert len(near) == 1, said
    assert near[0].startswith("node2 GPU 1 holds 76.7 of 79.6 GiB (96%)"), near


def test_one_odd_reading_names_nothing_however_often_it_is_looked_at():
    """A reading counts once in a verdict's streak: looked at on three ticks (the launcher looks
    every second, a node reads every two), one GPU at 96% of its memory is not yet named."""
    fleet = GpuFleet()
    fleet.observe("node0", NEAR[0], 0.0)
    said = [line for t in (0.0, 1.1, 2.2) for line in fleet.tick(t, step=None, first_step=None)]
    assert said == []
    fleet.observe("node0", NEAR[1], 3.0)
    said = fleet.tick(3.3, step=None, first_step=None)
    assert len(said) == 1 and said[0].startswith("node0 GPU 1 holds")


def test_a_throttled_gpu_is_named_but_the_power_cap_of_a_busy_gpu_is_not():
    hot = [";".join(("0, 97, 62000, 81559, 420.0, 87, 1155, 0x0000000000000040" if part.startswith("0,") else part)
                    for part in reading.split(";")) for reading in BUSY]
    said = feed(GpuFleet(), {"node0": BUSY, "node1": hot}, 20)
    assert len(said) == 1 and said[0].startswith("node1 GPU 0 is throttled: HW thermal slowdown, SM clock 1155 MHz, 87 C"), said


def beating(fleet: GpuFleet, samples: dict[str, list[str] | None], seconds: int, start: int = 0) -> list[str]:
    """Each host's heartbeat every second and its reading every other one (None: no reading), the
    fleet looked at every second; what was named."""
    said = []
    for t in range(start, start + seconds):
        for host, readings in samples.items():
            fleet.beat(host)
            if readings is not None and t % 2 == 0:
                fleet.observe(host, readings[(t // 2) % len(readings)], float(t))
        said += fleet.tick(t + 0.5, step=t, first_step=0.0)
    return said


def test_a_node_whose_readings_stop_is_named_once_and_its_last_reading_is_not_shown_as_now():
    fleet = GpuFleet()  # (a reading every 2 s, a beat every second: 20 beats without one)
    assert fleet.silent_beats == 20
    assert beating(fleet, {"node0": BUSY, "node1": BUSY, "node2": NEAR}, 60) == \
        [s for s in fleet.named if "out-of-memory" in s]  # (node2's GPU 1: its own verdict, nothing of readings)
    fleet.named.clear()
    said = beating(fleet, {"node0": BUSY, "node1": None, "node2": NEAR}, 40, start=60)
    assert len(said) == 1 and said[0].startswith("node1's GPU readings stopped: none in its last 20 heartbeats (20s) "
                                                 "while the node itself answers. Its nvidia-smi loop hung or ended"), said
    # its GPUs are out of the live figures: the fleet is node0 and node2 (node0's own reading is the busiest)
    assert fleet.live() == GpuFleet.live(only(fleet, "node0", "node2"))
    # back: judged again from its new readings, named again only if they stop again
    assert beating(fleet, {"node0": BUSY, "node1": BUSY, "node2": NEAR}, 30, start=100) == []
    said = beating(fleet, {"node0": BUSY, "node1": None, "node2": NEAR}, 25, start=130)
    assert len(said) == 1 and said[0].startswith("node1's GPU readings stopped"), said


def test_the_summary_says_a_nodes_figures_are_of_few_readings_when_its_readings_stopped():
    fleet = GpuFleet()
    beating(fleet, {"node0": BUSY, "node1": BUSY}, 6)
    beating(fleet, {"node0": BUSY, "node1": None}, 40, start=6)
    lines = summary_lines(fleet.record())
    assert lines[0].endswith("(8 GPU(s))") and lines[0].startswith("  GPUs         node0 "), lines
    assert lines[1].endswith("(8 GPU(s), over 3 readings only (23 on the node read most))"), lines
    assert lines[2].startswith("  named        node1's GPU readings stopped"), lines


def only(fleet: GpuFleet, *hosts: str) -> GpuFleet:
    """A fleet of ``hosts``' readings alone (their latest, as ``fleet`` holds them)."""
    other = GpuFleet()
    other.nodes = {h: fleet.nodes[h] for h in hosts}
    return other


def test_a_node_that_never_sends_a_reading_is_named_and_a_slower_sampling_waits_longer():
    said = beating(GpuFleet(), {"node0": BUSY, "node1": None}, 30)
    assert len(said) == 1 and said[0].startswith("node1 has sent no GPU reading in its last 20 heartbeats (20s) while "
                                                 "the node itself answers: its nvidia-smi loop"), said
    # beats that came between two looks (a loaded launcher takes them in a batch): the rule's count is said
    late = GpuFleet()
    for _ in range(23):
        late.beat("node1")
    assert late.tick(1.0, step=None, first_step=None)[0].startswith("node1 has sent no GPU reading in its last 20 "
                                                                     "heartbeats (20s)")
    slow = GpuFleet(every_s=5.0)  # (FTB_GPU_SAMPLE_S=5: ten readings' time is 50 beats)
    assert slow.silent_beats == 50
    assert beating(slow, {"node0": BUSY, "node1": None}, 45) == []
    assert len(beating(slow, {"node0": BUSY, "node1": None}, 10, start=45)) == 1


def test_a_paused_launcher_names_no_node_silent():
    """The launcher stopped for a minute (a laptop's lid, SIGSTOP, a starved CPU): the nodes'
    lines wait in their channels and come in a burst, readings and beats in the order written.
    Counted in beats, not in the launcher's seconds: nobody is silent."""
    fleet = GpuFleet()
    beating(fleet, {"node0": BUSY, "node1": BUSY}, 30)
    for t in range(30, 90):  # (what the nodes wrote while the launcher slept, taken at once at 90.0)
        for host in ("node0", "node1"):
            fleet.beat(host)
            if t % 2 == 0:
                fleet.observe(host, BUSY[t % len(BUSY)], 90.0)
    assert fleet.tick(90.5, step=90, first_step=0.0) == []
    assert fleet.live() is not None


@pytest.mark.parametrize("idle", [None, "gpu-077"])
def test_a_healthy_busy_fleet_of_256_hosts_names_nobody(idle):
    """256 hosts, noisy utilization (80-100%), memory below 95%, the SW power cap on and off, the
    real H100's recorded under-load readings on some (at its power cap), readings late and out of
    step as on a loaded launcher: nothing named over 10 minutes; with one host idle, that host alone."""
    rnd = random.Random(256)
    recorded = [r for r in readings_of(RECORDED) if ", 100, " in r]
    assert len(recorded) >= 40 and any(r.endswith("0x0000000000000004") for r in recorded)  # (at its power cap)
    fleet = GpuFleet()
    said = []
    for tick in range(300):
        t = tick * 2.0
        for h in range(256):
            fleet.beat(f"gpu-{h:03d}")  # (two heartbeats a reading)
            fleet.beat(f"gpu-{h:03d}")
            if rnd.random() < 0.1:  # a reading that did not come this time (late, dropped)
                continue
            at = t + rnd.uniform(0, 1.5)
            if h % 16 == 0:  # (its readings under load, in the order recorded: its idle start and end were not a run)
                reading = recorded[(tick + h) % len(recorded)]
            else:
                reading = ";".join(f"{g}, {rnd.randint(80, 100)}, {rnd.randint(50000, 77000)}, 81559, "
                                   f"{rnd.uniform(500, 700):.1f}, {rnd.randint(50, 75)}, 1980, "
                                   f"{rnd.choice(['0x0000000000000004', '0x0000000000000000'])}" for g in range(8))
            if f"gpu-{h:03d}" == idle:
                reading = IDLE[tick % len(IDLE)]
            fleet.observe(f"gpu-{h:03d}", reading, at)
        said += fleet.tick(t + 1.6, step=tick, first_step=0.0)
    if idle is not None:
        assert len(said) == 1 and said[0].startswith(f"{idle}'s GPUs idle well below"), said[:5]
        return
    assert said == [], said[:5]
    assert len(fleet.nodes) == 256
    assert fleet.live() is not None and fleet.live().endswith("GiB")


def test_the_summary_record_the_live_field_and_the_curve():
    fleet = GpuFleet()
    feed(fleet, {"node0": BUSY, "node1": NEAR}, 30)
    record = fleet.record()
    node1 = record["nodes"]["node1"]
    assert node1["gpus"] == 8 and node1["mem_total_mib"] == 81559 and 78450 <= node1["mem_peak_mib"] <= 78650
    assert 90 <= node1["util_mean"] <= 99 and node1["readings"] == 15
    assert record["named"] and "node1 GPU 1" in record["named"][0]
    lines = summary_lines(record)
    assert lines[0].startswith("  GPUs         node0 9") and "busy on average, peak" in lines[0]
    assert any(line.startswith("  named        node1 GPU 1 holds") for line in lines)
    assert runs_cell(record).endswith("77/80G") and runs_cell(None) == "-"
    p = Progress(gpus=fleet)
    p.step, p.total = 3, 10
    assert " GPU 9" in status_line(p, 2, 2) and "/80 GiB" in status_line(p, 2, 2)
    assert status_line(Progress(), 1, 1).count("GPU") == 0  # (a CPU job: nothing of it)
    assert fleet.curve and all(set(c) == {"current_steps", "gpu_util", "gpu_mem_gib"} for c in fleet.curve)
    assert [c["current_steps"] for c in fleet.curve] == sorted(c["current_steps"] for c in fleet.curve)


def test_the_curve_stays_small_over_a_week():
    fleet = GpuFleet()
    fleet.observe("node0", BUSY[0], 0.0)
    for t in range(0, 7 * 24 * 3600, 10):
        fleet.point(float(t), t // 10)
    assert len(fleet.curve) <= gpu_metrics.CURVE_MAX
    assert fleet.curve[-1]["current_steps"] > 0.9 * (7 * 24 * 360)  # (thinned, not cut: it reaches the end)


def test_status_names_what_one_reading_shows():
    readings = {"node0": parse_line(BUSY[0]), "node1": parse_line(IDLE[0]), "node2": parse_line(NEAR[0])}
    lines = status_lines(readings)
    assert lines[0].startswith("GPUs now")
    assert sum(1 for line in lines if line.startswith("  gpu  ")) == 24
    assert any(line.startswith("  idle: node1's GPUs") for line in lines), lines
    assert any(line.startswith("  memory: node2 GPU 1 holds") for line in lines), lines
    assert not any("node0" in line for line in lines if not line.startswith("  gpu  "))
    assert status_lines({}) == []
    # a running node whose nvidia-smi gave nothing within its 2 s: said, not left out
    lines = status_lines({"node0": parse_line(BUSY[0]), "node1": parse_line("-")})
    assert lines[0].startswith("GPUs now") and lines[1].startswith("  gpu  node1") and \
        "no reading: nvidia-smi gave none within 2s" in lines[1], lines
    assert len(lines) == 10, lines  # (node0's 8 GPUs: nothing judged of node1's missing reading)
    assert status_lines({"node1": []})[1].startswith("  gpu  node1"), lines


@pytest.mark.parametrize("text", ["", "No devices were found", "0, [N/A], [N/A], 81559, [N/A], 40, 1980, [N/A]"])
def test_readings_that_say_nothing_break_nothing(text):
    found = parse_line(text)
    assert all(r.util is None for r in found)
    fleet = GpuFleet()
    fleet.observe("node0", text, 0.0)
    assert fleet.tick(5.0, step=None, first_step=None) == []


def test_a_runs_gpu_figures_cover_every_attempt_not_the_last_alone():
    """A restart makes a new attempt, with a fleet of its own: the summary's figures (summary.json,
    the closing lines) are over the whole run, a node's mean over all its readings."""
    busy, idle = readings_of(SMI / "h100-x8.metrics.csv"), readings_of(SMI / "h100-x8-idle.metrics.csv")
    first, second = GpuFleet(), GpuFleet()
    for i, text in enumerate(busy[:6]):  # attempt 1: node0 and node1 busy, then node1 is lost
        first.observe("node0", text, float(i))
        first.observe("node1", text, float(i))
    first.named.append("node1 GPU 3 holds 79.0 of 80.0 GiB")
    for i, text in enumerate(idle[:2]):  # attempt 2: node0 and a spare, idle (the restart's loading)
        second.observe("node0", text, 10.0 + i)
        second.observe("spare0", text, 10.0 + i)

    def means(texts):
        per = [sum(r.util for r in parse_line(t)) / len(parse_line(t)) for t in texts]
        return per

    whole = gpu_metrics.over_attempts([first, None, second])
    node0 = whole["nodes"]["node0"]
    expected = means(busy[:6]) + means(idle[:2])
    assert node0["readings"] == 8 and node0["util_mean"] == pytest.approx(sum(expected) / 8, abs=0.1)
    assert node0["util_mean"] != second.record()["nodes"]["node0"]["util_mean"]  # (the last attempt alone: idle)
    assert node0["mem_peak_mib"] == max(first.record()["nodes"]["node0"]["mem_peak_mib"],
                                        second.record()["nodes"]["node0"]["mem_peak_mib"])
    assert list(whole["nodes"]) == ["node0", "node1", "spare0"]  # every node that ran, the lost one too
    assert whole["named"] == ["node1 GPU 3 holds 79.0 of 80.0 GiB"]
    assert any(line.startswith("  GPUs         node1 ") for line in summary_lines(whole))
    # one attempt: its own record, as it was; none read: None
    assert gpu_metrics.over_attempts([first]) == first.record()
    assert gpu_metrics.over_attempts([None, None]) is None
