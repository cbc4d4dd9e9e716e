"""The whole run slowing is said while it goes, and its return (ftbundle/ui/pace.py): 2
containerized hosts train a real LlamaFactory LoRA; once the run has a pace, both hosts' CPUs
are capped by their cgroups (`docker update --cpus`, what another job on the hosts or a starved
input would do to every node alike); the launcher says the run slowed (no straggler: every node
alike), then, the caps lifted, that it is back; summary.json and `runs --json` keep it. The
run is ended by `ftbundle stop`, as from another terminal: stopped, not failed; `status` then
judges the trainer log's records as the launcher did.

The pace's window is 20 s here (FTB_PACE_WINDOW_S; 300 s by default): 5 s chunks of the
trainer's clock."""

from __future__ import annotations

import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time

import pytest

from tests.support.helpers import REPO, base_job, quickstart_lora, write_job

pytestmark = pytest.mark.cluster


def elapsed(log) -> float:
    """The trainer's clock (trainer_log.jsonl's last elapsed_time), 0 before its first record."""
    from ftbundle.ui.pace import trainer_seconds

    try:
        last = log.read_text().strip().splitlines()[-1]
        return trainer_seconds(json.loads(last).get("elapsed_time")) or 0.0
    except (OSError, IndexError, ValueError):
        return 0.0


def paces(log, capped_at: float) -> tuple[float, float]:
    """The trainer log's pace before the caps and now, counted here as ftbundle/ui/pace.py defines
    them (its docstring): 5 s chunks of the trainer's clock, each its tokens over its seconds, the
    first two left out; the median of the chunks that ended by the caps, and of the last five."""
    from ftbundle.ui.pace import trainer_seconds

    points = [(trainer_seconds(r.get("elapsed_time")), r["total_tokens"])
              for r in map(json.loads, log.read_text().splitlines()) if "total_tokens" in r]
    chunks, (t0, n0) = [], points[0]
    for t, n in points[1:]:
        if t - t0 >= 5:
            chunks.append((t, (n - n0) / (t - t0)))
            t0, n0 = t, n
    chunks = chunks[2:]
    before = [rate for t, rate in chunks if t <= capped_at]
    return statistics.median(before), statistics.median(rate for _, rate in chunks[-5:])


def test_a_fleet_slowed_alike_is_said_while_it_goes_and_its_return(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    train = quickstart_lora(shared, max_steps=100_000, save_strategy="no", logging_steps=1)
    job = write_job(tmp_path / "job.yaml", base_job("pace", shared, inventory, {"llamafactory": train}))
    log = shared / "output/lora/trainer_log.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", str(job), "--no-check"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "FTB_PACE_WINDOW_S": "20"})
    lines: queue.Queue[str] = queue.Queue()
    out: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def wait_for(text: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                assert proc.poll() is None, "".join(out)[-3000:]
                continue
            out.append(line)
            if text in line:
                return line
        return ""

    capped = []
    try:
        # a pace first: 2 chunks of warm-up, then twice the window's (and 5 chunks at least)
        deadline = time.monotonic() + 400
        while elapsed(log) < 75:
            assert time.monotonic() < deadline and proc.poll() is None, f"trainer at {elapsed(log)} s"
            time.sleep(0.5)
        # `status` while it goes (another terminal): no checkpoint (save_strategy no), what a failure costs
        running = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job)], cwd=REPO,
                                 capture_output=True, text=True, timeout=120, check=False).stdout
        assert "state: running" in running, running
        assert re.search(rf"\ncheckpoint: none yet in {re.escape(str(log.parent))}; the trainer is at step \d+; "
                         r"a failure now starts again from step 0\n", running), running
        # `plot` while it goes: no metrics.jsonl yet (the launcher writes it at the end; a detached run's
        # never): the trainer's own log, not "its trainer logged no step"
        png = tmp_path / "running.png"
        plotted = subprocess.run([sys.executable, "-m", "ftbundle", "plot", str(job), "-o", str(png)], cwd=REPO,
                                 capture_output=True, text=True, timeout=120, check=False)
        assert plotted.returncode == 0 and png.stat().st_size > 10_000, plotted.stdout + plotted.stderr
        assert f"has no metrics.jsonl (detached, still running, or its launcher was lost): plotted from {log}" \
            in plotted.stderr, plotted.stderr
        # `runs` while it goes (no summary.json yet): its loss and tokens/s from the trainer's log, not "-"
        listed = subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"], cwd=REPO,
                                capture_output=True, text=True, timeout=120, check=True)
        [going] = json.loads(listed.stdout)
        assert going["state"] == "running?" and isinstance(going["final_loss"], float), going
        assert going["tokens_per_s"] > 0 and abs(going["tokens_per_s_per_rank"] - going["tokens_per_s"] / 2) <= 0.1, going
        # each rank gets about one core of 2 here; a tenth of one is a slowdown no noise explains
        capped_at = elapsed(log)
        for host in cluster.hosts:
            subprocess.run(["docker", "update", "--cpus", "0.1", host.container], check=True, capture_output=True)
            capped.append(host)
        slowed = wait_for("the run slowed to ", 180)
        assert slowed, "no slowdown said in 180 s:\n" + "".join(out)[-3000:]
        for host in capped:
            subprocess.run(["docker", "update", "--cpu-quota", "-1", host.container], check=True, capture_output=True)
        capped.clear()
        back = wait_for("the run is back to its pace: ", 240)
        if not back:
            # the machine's other load (CI runs other modules beside this one) may hold the uncapped run
            # under its pace before for all that time: then the silence is right, and must be so. The
            # rule says back at 0.85x the pace before (the median of the chunks before the slowdown was
            # found, a few capped ones among them); counted here from the caps, 0.9x leaves room for that
            # (a mean since the 10th second, as this test read it first, is not what the rule reads: CI's
            # run of 76dabe7 failed on 0.93x by that mean, with no return said)
            before, now = paces(log, capped_at)
            print(f"no return said: {now:,.0f} tok/s over the last 5 chunks against {before:,.0f} before the caps")
            assert now < 0.9 * before, (before, now, "".join(out)[-3000:])
    finally:
        for host in capped:
            subprocess.run(["docker", "update", "--cpu-quota", "-1", host.container], capture_output=True, check=False)
        subprocess.run([sys.executable, "-m", "ftbundle", "stop", str(job)], cwd=REPO, capture_output=True,
                       timeout=120, check=False)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    time.sleep(0.5)
    while not lines.empty():
        out.append(lines.get())
    text = "".join(out)
    print(text[-4000:])
    assert "warning: the run slowed to 0." in slowed, slowed
    ratio = float(slowed.split("the run slowed to ")[1].split("x")[0])
    assert ratio < 0.7, slowed
    assert " tok/s over its last " in slowed and "tok/s before" in slowed, slowed
    # both hosts were capped alike: no node is named the one that sets the pace
    assert slowed.rstrip().endswith("the step times name no straggler: every node slowed alike "
                                    "(their input, the network, the hosts)"), slowed
    if back:
        assert "warning" not in back and "before it slowed at step " in back, back
    assert text.count("the run slowed to ") == 1 and text.count("the run is back to its pace") == bool(back), text[-3000:]
    # (ended by `ftbundle stop` from here, as from another terminal: a stop, over SSH on both hosts)
    assert proc.returncode == 130 and "stopped by `ftbundle stop` (" in text and "failed" not in text, text[-3000:]

    runs = subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    [row] = json.loads(runs.stdout)
    assert row["state"] == "stopped", row
    [episode] = row["slowdowns"]
    assert episode["unit"] == "tok/s" and episode["ratio"] < 0.7, episode
    assert (episode["back_step"] > episode["step"]) if back else episode["back_step"] is None, episode
    # `status` judges the trainer log's last records as the launcher did (a detached run, another terminal)
    status = subprocess.run([sys.executable, "-m", "ftbundle", "status", str(job)], cwd=REPO,
                            env={**os.environ, "FTB_PACE_WINDOW_S": "20"},
                            capture_output=True, text=True, timeout=120, check=False).stdout
    assert "\npace: " in status and " tok/s over its last " in status, status
    assert "  slowed to " in status and f"at step {episode['step']} (" in status, status
    assert (", back at step " if back else ", still slow") in status, status
    table = subprocess.run([sys.executable, "-m", "ftbundle", "runs", str(job)], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"  slowed to {episode['ratio']:.2f}x at step {episode['step']} (" in table, table
