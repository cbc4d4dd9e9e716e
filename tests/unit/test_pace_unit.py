"""A week-long run's pace (ftbundle/ui/pace.py): the whole run slowing is said while it goes, once,
and its return; a healthy run with its saves, evaluations and noisy steps says nothing; and a
run past its first day still has a clock (LlamaFactory writes "1 day, 0:00:05")."""

from __future__ import annotations

import json
import random
from datetime import timedelta

from ftbundle.history import format_runs, run_row, run_summary
from ftbundle.ui import stragglers
from ftbundle.ui.pace import BACK, Pace, recorded, status_lines, trainer_seconds
from ftbundle.ui.progress import Progress
from ftbundle.ui.summary import closing_summary


def records(rate, seconds: int, *, every: float = 2.0, saves=(), seed: int = 1, tokens: bool = True):
    """trainer_log.jsonl records as LlamaFactory writes them: a record every ``every`` seconds of
    the trainer's clock (+-15%; its elapsed_time in whole seconds, as timedelta prints it), its
    tokens counted at ``rate(t)`` a second, nothing counted during ``saves`` ((start, seconds)
    pairs: a checkpoint's save, an evaluation). Without tokens, a record a step, each as much
    longer than ``every`` as ``rate(t)`` is below ``rate(0)``."""
    rng = random.Random(seed)
    t, count, step, out = 0.0, 0.0, 0, []
    while t < seconds:
        pause = next((length for start, length in saves if start <= t < start + every), 0)
        # (a trainer counting no tokens: its steps take longer as its rate falls)
        took = (every if tokens else every * rate(0) / rate(t)) * rng.uniform(0.85, 1.15)
        t += took + pause
        step += 1
        count += rate(t) * took * rng.uniform(0.85, 1.15)  # (batches of their own lengths)
        record = {"current_steps": step, "total_steps": 10**6, "loss": 1.0,
                  "elapsed_time": str(timedelta(seconds=int(t))), "remaining_time": "1 day, 2:00:00"}
        if tokens:
            record["total_tokens"] = int(count)
        out.append(record)
    return out


def feed(pace: Pace, recs) -> list[tuple[int, str]]:
    """What the pace said, with the step it was said at."""
    said = []
    for r in recs:
        pace.feed(trainer_seconds(r["elapsed_time"]), r.get("total_tokens"), r["current_steps"])
        if (taken := pace.take()) is not None:
            said.append((r["current_steps"], taken[0]))
    return said


def test_a_healthy_run_with_its_saves_evaluations_and_noise_says_nothing_in_a_day():
    # 5,000 tok/s +-15% a record, a 60 s checkpoint save every 30 min and a 90 s evaluation every
    # hour (both inside the trainer's clock, counting nothing), for 24 hours
    saves = [(s, 60) for s in range(1800, 86400, 1800)] + [(s + 900, 90) for s in range(3600, 86400, 3600)]
    pace = Pace(300)
    assert feed(pace, records(lambda t: 5000, 86400, saves=saves)) == []
    assert pace.slowdowns == [] and pace.record() == []
    # and a run whose steps are slow (a record every 10 min: the pace needs 5 of them)
    assert feed(Pace(300), records(lambda t: 900, 86400, every=600.0, seed=3)) == []


def test_the_whole_run_slowing_is_said_once_and_its_return_once():
    # 8,000 tok/s; from hour 3 to hour 4, 3,600 (0.45x: every node waiting on its input)
    def rate(t):
        return 3600 if 3 * 3600 <= t < 4 * 3600 else 8000
    pace = Pace(300)
    said = feed(pace, records(rate, 6 * 3600))
    assert len(said) == 2, said
    (slow_step, slow), (back_step, back) = said
    # found within the window (5 min) of its start, and its return within the window of its end
    assert 3 * 3600 / 2 < slow_step <= (3 * 3600 + 300) / 2, said
    assert 4 * 3600 / 2 < back_step <= (4 * 3600 + 300) / 2, said
    assert slow.startswith("the run slowed to 0.") and "tok/s over its last 5 min" in slow, slow
    assert "against 8,0" in slow or "against 7,9" in slow, slow
    assert back.startswith("the run is back to its pace: ") and f"before it slowed at step {slow_step})" in back
    [episode] = pace.record()
    assert 0.40 < episode["ratio"] < 0.50 and episode["unit"] == "tok/s"  # (its slowest 5 min: 3,600 / 8,000)
    assert episode["step"] == slow_step and episode["back_step"] == back_step
    assert episode["back_rate"] >= BACK * episode["before"]


def test_a_slowdown_longer_than_the_pace_before_it_is_judged_against_that_pace():
    # slow from hour 1 to the end of hour 5: the median of all chunks would become the slow pace;
    # the return is judged against the pace before the slowdown, and it stays slow to the end
    pace = Pace(300)
    said = feed(pace, records(lambda t: 2000 if t >= 3600 else 6000, 5 * 3600, tokens=False))
    assert [text.split(" to 0.")[0] for _, text in said] == ["the run slowed"], said
    assert "steps/s" in said[0][1]  # (no token count: the trainer's steps)
    [episode] = pace.record()
    assert episode["back_step"] is None
    assert pace.slowed is not None


def test_a_slowdown_of_under_a_third_or_a_resumed_clock_is_no_slowdown():
    # 0.75x for an hour: within the rule's margin
    assert feed(Pace(300), records(lambda t: 7500 if 3600 <= t < 7200 else 10000, 3 * 3600)) == []
    # a resumed trainer: its clock starts again (elapsed and count lower): no rate from across it,
    # and its first chunks (loading, compiling: a tenth of the pace here) are left out as a fresh one's
    pace = Pace(300)
    first = records(lambda t: 5000, 3600, every=60.0)
    again = records(lambda t: 500 if t < 250 else 5000, 3600, every=60.0, seed=2)
    assert feed(pace, first + again) == []
    # ... and a slowdown after the resume is judged on the resumed clock's last window, as before it
    # (its times go on from the first clock's: not an hour of the old clock's chunks counted "recent")
    pace = Pace(300)
    slow_later = records(lambda t: 1500 if t >= 1200 else 5000, 3600, seed=4)
    said = feed(pace, records(lambda t: 5000, 3600) + slow_later)
    assert [text.split(" to ")[0] for _, text in said] == ["the run slowed"], said
    assert 1200 / 2 < said[0][0] <= (1200 + 300) / 2, said


def test_the_live_warning_says_whether_a_node_sets_the_pace_and_the_summary_and_runs_keep_it(tmp_path):
    def rate(t):
        return 1000 if t >= 1800 else 4000

    def run(nodes):
        p = Progress()
        p.node_steps = nodes
        p._slowest = stragglers.live_field(nodes.values())  # (as feed_steps judges it)
        said = []
        for r in records(rate, 3600):
            p.feed_record(r)
            if (paced := p.pace_tick()) is not None:
                said.append(paced)
        return p, said

    alike = {h: stragglers.NodeSteps(h, 100, 0.2, 0.3) for h in ("node0", "node1")}
    p, said = run(alike)
    [(text, warn)] = said
    assert warn and text.startswith("the run slowed to 0.") and text.endswith(
        "; the step times name no straggler: every node slowed alike (their input, the network, the hosts)"), text
    _, said = run({**alike, "node1": stragglers.NodeSteps("node1", 100, 0.5, 0.6)})
    [(text, warn)] = said
    assert warn and text.endswith("; the slowest node: node1 1.4x the fleet's median step compute"), text
    _, said = run({})  # (a single node, or no step times: nothing more is claimed)
    assert said[0][0].endswith(" before"), said

    summary = closing_summary(run_id="r", run_dir="/d", duration_s=3600, progress=p, output_dir=None,
                              adapter=None, nnodes=2)
    [line] = [s for s in summary if s.startswith("  slowed ")]
    assert line.startswith("  slowed       to 0.2") and " tok/s against 4,0" in line and line.endswith(
        "), slow to the end"), line
    record = p.pace.record()
    row = run_row("j-20261202-120000-abc", {"plan.json": json.dumps({"job": "j", "nodes": []}),
                                           "summary.json": json.dumps({"state": "finished", "slowdowns": record})})
    assert row.slowdowns == record
    assert "\n  slowed to 0.2" in format_runs([row])
    # a summary.json whose slowdowns are not the record's: left out, `runs` still reads
    bad = run_row("j-20261202-120000-abc", {"plan.json": json.dumps({"job": "j", "nodes": []}),
                                           "summary.json": json.dumps({"state": "x", "slowdowns": [{"ratio": "?"}, 3]})})
    assert bad.slowdowns == [] and recorded("nope") == []


def test_summary_json_carries_the_slowdowns():
    class Plan:
        run_id, job_name, nodes, nproc_per_node, checkpoint_dir = "r", "j", [], 1, None
    p = Progress()
    for r in records(lambda t: 1000 if t >= 1800 else 4000, 3600):
        p.feed_record(r)
        p.pace_tick()
    summary = run_summary(Plan(), exit_code=0, interrupted=False, attempt=1, started=0.0, duration_s=3600.0,
                          progress=p, failed_host=None)
    assert [s["step"] for s in summary["slowdowns"]] == [s.step for s in p.pace.slowdowns] and summary["slowdowns"]


def test_status_reads_the_pace_from_the_trainer_logs_text():
    """`ftbundle status` (a detached run, another terminal) judges the trainer log's last records as
    the launcher judges them live: the pace now against before, and each slowdown, one still going
    said "still slow"; a log too short to judge, or no log, says nothing."""
    def rate(t):
        return 2000 if t >= 3600 else 6000
    text = "not json\n" + "\n".join(json.dumps(r) for r in records(rate, 2 * 3600)) + "\n"
    lines = status_lines(text)
    assert lines[0].startswith("pace: ") and " tok/s over its last 5 min (step " in lines[0], lines
    assert "x its 6,0" in lines[0] or "x its 5,9" in lines[0], lines
    assert lines[1].startswith("  slowed to 0.3") and lines[1].endswith(", still slow"), lines
    healthy = "\n".join(json.dumps(r) for r in records(lambda t: 6000, 3600))
    [line] = status_lines(healthy)
    assert line.startswith("pace: ") and "(step " in line, line
    assert 0.85 < float(line.split("), ")[1].split("x its")[0]) < 1.15, line
    assert status_lines("\n".join(json.dumps(r) for r in records(lambda t: 6000, 60))) == []
    assert status_lines("") == []


def test_the_launcher_looking_once_a_tick_and_status_after_every_record_name_the_same_steps():
    """The launcher takes what the pace says once a tick, after however many records came since;
    `status` judges the log after every record. Each slowdown was recorded at the step of the
    record before the look: CI saw the live line say step 1394 and `status` step 1390 for one
    slowdown. Judged as each chunk closes, both name the same steps and rates."""
    def rate(t):
        return 3600 if 3 * 3600 <= t < 4 * 3600 else 8000
    recs = records(rate, 6 * 3600)
    rng = random.Random(5)
    p, said, i = Progress(), [], 0
    while i < len(recs):
        batch = recs[i:i + rng.randint(1, 9)]
        i += len(batch)
        for r in batch:
            p.feed_record(r)
        if (paced := p.pace_tick()) is not None:
            said.append(paced)
    text = "\n".join(json.dumps(r) for r in recs)
    assert p.pace.record() == status_pace(text).record() and len(p.pace.record()) == 1, p.pace.record()
    assert [warning for _, warning in said] == [True, False], said
    episode = p.pace.record()[0]
    assert f"(step {episode['step']}) against " in said[0][0] and f"(step {episode['back_step']}; " in said[1][0], said
    lines = status_lines(text)
    assert f"  slowed to {episode['ratio']:.2f}x at step {episode['step']} (" in lines[1], lines


def status_pace(text: str) -> Pace:
    """The Pace `status_lines` builds from a log's text, record after record."""
    pace = Pace()
    for line in text.splitlines():
        r = json.loads(line)
        pace.feed(trainer_seconds(r["elapsed_time"]), r.get("total_tokens"), r["current_steps"])
    return pace
