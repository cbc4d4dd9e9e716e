"""What a person sees running the quickstart for real: on a terminal (tmux reads the
screen) and through a pipe; then `ftbundle runs` and `ftbundle plot` on those runs, and
the failure summary with the failing rank's own traceback."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import REPO, free_port
from tests.train.test_quickstart import quickstart_copy, tiny_model  # noqa: F401 - the session's tiny model

pytestmark = pytest.mark.train

PIPED_MAX_LINES = 80
SCREEN_MAX_LINES = 60
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"  # rich's "dots": the live line is on the screen


def ftb(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """ftbundle with stdout and stderr in one stream, as a pipe (`| tee`) would see them."""
    return subprocess.run([sys.executable, "-m", "ftbundle", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=REPO)


def last_logged(output_dir: Path) -> dict:
    """LlamaFactory's last trainer_log.jsonl record with a loss (the very last may have none)."""
    records = [json.loads(line) for line in (output_dir / "trainer_log.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r][-1]


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory, tiny_model):  # noqa: F811
    """The quickstart, once, with its output piped."""
    job = quickstart_copy(tmp_path_factory.mktemp("piped"), tiny_model)
    t0 = time.monotonic()
    proc = ftb("run", str(job))
    print(f"piped quickstart: {time.monotonic() - t0:.1f}s")
    return job, proc


def test_piped_output_is_short_plain_and_summarized(piped_run):
    job, proc = piped_run
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    lines = out.splitlines()
    assert len(lines) <= PIPED_MAX_LINES, f"{len(lines)} lines:\n{out}"
    assert "\r" not in out and "\x1b[" not in out
    for phase in ("checking 1 host(s)", "staging the run directory", "launching on 1 node(s)", "training: "):
        assert any(phase in line for line in lines), (phase, out)
    progress = [line for line in lines if line.startswith("ftbundle: training: step")]
    assert progress and progress[-1].split()[3] == "60/60", out
    assert "loss " in progress[-1] and "nodes 1/1" in progress[-1]
    assert "{'loss'" not in out and "Running tokenizer" not in out  # the raw log stays in the run directory
    output_dir = job.parent / ".shared/output/quickstart-lora"
    final = last_logged(output_dir)
    assert f"final loss   {final['loss']:.4f}" in out
    assert f"adapter      {output_dir}/adapter_model.safetensors" in out
    run_dir = next((job.parent / ".shared/runs").iterdir())
    assert f"run dir      {run_dir}" in out
    assert "{'loss'" in (run_dir / "node-0-localhost.a1.log").read_text()


def test_runs_lists_the_run_with_its_final_loss(piped_run):
    job, _ = piped_run
    table = ftb("runs", str(job), timeout=120)
    assert table.returncode == 0, table.stdout
    rows = ftb("runs", str(job), "--json", timeout=120)
    data = json.loads(rows.stdout)
    assert len(data) == 1
    row = data[0]
    final = last_logged(job.parent / ".shared/output/quickstart-lora")
    assert row["state"] == "finished" and row["exit_code"] == 0 and row["hosts"] == ["localhost"]
    assert row["final_loss"] == pytest.approx(final["loss"]) and row["duration_s"] > 5
    assert row["output_dir"] == str(job.parent / ".shared/output/quickstart-lora")
    header, line = table.stdout.splitlines()
    assert header.split()[:2] == ["RUN", "HOSTS"] and line.startswith(row["run_id"]) and "finished" in line


def test_plot_writes_a_png_of_one_run_and_of_two_overlaid(piped_run, tmp_path):
    from PIL import Image

    job, _ = piped_run
    png = tmp_path / "loss.png"
    proc = ftb("plot", str(job), "-o", str(png), timeout=120)
    assert proc.returncode == 0, proc.stdout
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] >= 800 and image.size[1] >= 600
    # a second run (the first's record under a new id) overlaid on the first
    runs = job.parent / ".shared/runs"
    first = next(runs.iterdir())
    second = runs / first.name.replace(first.name[-4:], "beef")
    shutil.copytree(first, second)
    records = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    (second / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": r["loss"] + 0.5}) + "\n" for r in records))
    both = tmp_path / "both.png"
    proc = ftb("plot", str(job), "--run", first.name, "--run", second.name, "-o", str(both), timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert both.stat().st_size > png.stat().st_size  # a second curve and a longer legend
    bad = ftb("plot", str(job), "--run", "nope", timeout=120)
    assert bad.returncode == 2 and "no run 'nope'" in bad.stdout
    shutil.copy(png, Path(os.environ.get("FTB_TEST_ARTIFACTS", tmp_path)) / "quickstart-loss.png")


def _tmux(session: str, *args: str) -> subprocess.CompletedProcess:
    """tmux on a server of the session's own (``-L``): two tests sharing the default server raced
    it, one's new session reaching the server the other's kill had just told to exit ("server
    exited unexpectedly", seen once in CI)."""
    return subprocess.run(["tmux", "-L", session, "-f", "/dev/null", *args], capture_output=True, text=True)


def test_plot_on_a_terminal_without_output_draws_in_the_terminal(piped_run, tmp_path):
    job, _ = piped_run
    session = f"ftb-plot-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "plot.sh"
    script.write_text(f"cd {shlex.quote(str(REPO))}\n{shlex.quote(sys.executable)} -m ftbundle plot "
                      f"{shlex.quote(str(job))}\necho FTB-EXIT=$?\nsleep 120\n")
    assert _tmux(session, "new-session", "-d", "-s", session, "-x", "100", "-y", "50", "bash", str(script)).returncode == 0
    try:
        deadline = time.monotonic() + 60
        screen = ""
        while "FTB-EXIT=" not in screen and time.monotonic() < deadline:
            time.sleep(0.3)
            screen = _tmux(session, "capture-pane", "-p", "-t", session).stdout
    finally:
        _tmux(session, "kill-server")
    assert "FTB-EXIT=0" in screen, screen
    run_id = next((job.parent / ".shared/runs").iterdir()).name
    assert "learning rate" in screen and "step" in screen and run_id[:30] in screen, screen
    assert screen.count("┤") >= 6 and not (REPO / "loss.png").exists()  # axes drawn, no file written


def test_terminal_shows_live_progress_and_the_quickstart_fits_a_screen(tmp_path, tiny_model):  # noqa: F811
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: .ci/tools.sh installs it")
    job = quickstart_copy(tmp_path, tiny_model)
    session = f"ftb-ux-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "run.sh"
    script.write_text(f"cd {shlex.quote(str(REPO))}\n"
                      f"{shlex.quote(sys.executable)} -m ftbundle run {shlex.quote(str(job))}\n"
                      "echo FTB-EXIT=$?\nsleep 600\n")
    assert _tmux(session, "new-session", "-d", "-s", session, "-x", "120", "-y", "80", "bash", str(script)).returncode == 0
    live = []
    before_steps = set()  # the live line's text in the training phase before the first step
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            screen = _tmux(session, "capture-pane", "-p", "-t", session).stdout
            if "FTB-EXIT=" in screen:
                break
            if any(line.lstrip()[:1] in SPINNER and "training" in line and "step" in line
                   for line in screen.splitlines()):
                live.append(screen)
            for line in screen.splitlines():
                body = line.strip()
                if body[:1] in SPINNER and body[1:].strip().startswith("training") and "step " not in body:
                    # (the stage, its own seconds, then the whole wait's: "loading model  2s  (31s since launch)")
                    before_steps.add(re.sub(r"\s+\d+s(\s+\(\d+s since launch\))?$", "",
                                            body[1:].strip()[len("training"):].strip()))
            time.sleep(0.25)
        whole = _tmux(session, "capture-pane", "-p", "-S", "-", "-t", session).stdout
    finally:
        _tmux(session, "kill-server")
    lines = whole.rstrip("\n").splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("FTB-EXIT="))
    assert lines[end] == "FTB-EXIT=0", whole
    assert end <= SCREEN_MAX_LINES, f"{end} lines on the screen:\n{whole}"
    # the live line was there while training: a bar, step/total, loss, nodes alive
    assert live, whole
    frame = live[-1]
    assert "/60" in frame and "eta" in frame and "loss" in frame and "lr" in frame and "nodes 1/1" in frame, frame
    assert all(len(line) <= 80 for line in frame.splitlines() if "training" in line or "loss" in line), frame
    shown = "\n".join(lines[:end])
    assert "finished run quickstart-lora-" in shown and "final loss" in shown and "adapter" in shown
    assert "{'loss'" not in shown
    assert "ftbundle: before the first step " in shown and "imports (torch, transformers, LlamaFactory) " in shown
    # before the first step: phases from what the ranks do, never a (truncated) raw log line
    assert before_steps, whole
    phases = ("starting the ranks", "starting LlamaFactory", "waiting for ranks", "loading tokenizer (2 ranks connected)", "loading dataset",
              "tokenizing dataset", "loading model", "preparing the model (LoRA)", "starting the first step")
    assert before_steps <= set(phases), before_steps
    print(f"quickstart on a terminal: {end} lines; {len(live)} live progress frames seen; "
          f"before the first step: {sorted(before_steps, key=phases.index)}")


def gloo_script_job(tmp_path: Path, name: str, failing: str) -> Path:
    """A 2-rank gloo script job on localhost. Both ranks join the group, then run ``failing``
    (top-level code that makes one of them fail), then wait a minute."""
    (tmp_path / f"{name}.py").write_text(
        "import ctypes, sys, time\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nrank = dist.get_rank()\ntime.sleep(1)\n"
        + failing + "time.sleep(60)\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": name, "nproc_per_node": 2, "master_port": free_port(),
        "shared_dir": ".shared", "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "runtime": {"kind": "host", "python": sys.executable}, "train": {"script": f"{name}.py"}}))
    return job


def test_failure_summary_shows_the_failing_ranks_own_traceback(tmp_path):
    job = gloo_script_job(tmp_path, "boom", "if rank == 1:\n    raise ValueError(f'boom on rank {rank}')\n")
    proc = ftb("run", str(job), timeout=180)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "failed: host localhost (127.0.0.1), node rank 0, rank 1, local rank 1; exit code 1" in out
    summary = out[out.index("failed: host"):]
    assert "its own traceback:" in summary and "raise ValueError(f'boom on rank {rank}')" in summary
    assert summary.splitlines()[summary.splitlines().index("its own traceback:") + 1].strip() == \
        "Traceback (most recent call last):"
    assert "  ValueError: boom on rank 1" in summary and "ChildFailedError" not in summary
    # local rank 1's own output is in a file of its own in the run directory, not in the node log
    run_dir = next((tmp_path / ".shared/runs").iterdir())
    stderr_files = list((run_dir / "ranks/node-0").glob("*/attempt_0/1/stderr.log"))
    assert len(stderr_files) == 1 and "boom on rank 1" in stderr_files[0].read_text()
    assert "boom on rank 1" not in (run_dir / "node-0-localhost.a1.log").read_text().split("ChildFailedError")[0]
    record = json.loads((run_dir / "summary.json").read_text())
    # the failure's line (`runs`, a webhook) names the rank and what it raised, not torchrun's exit 1 alone
    line = "exited with code 1; rank 1 (local rank 1): exit code 1; ValueError: boom on rank 1"
    assert record["state"] == "failed" and record["failure"]["line"] == line, record
    assert f"  failed on localhost: {line}" in ftb("runs", str(job), timeout=120).stdout


@pytest.mark.parametrize("local_rank", [1, 0])
def test_a_rank_that_aborts_in_native_code_is_shown_by_its_last_words_not_torchruns_traceback(tmp_path, local_rank):
    """A rank that dies in C++ (a real std::terminate, as torch's teardown at exit did in CI)
    has no Python traceback: the summary shows its last lines on stderr (its own file for a
    local rank > 0, the node log for local rank 0) and a hint, never torchrun's own
    ChildFailedError traceback as if it were the rank's."""
    job = gloo_script_job(tmp_path, "abort", (
        f"if rank == {local_rank}:\n    print('Training completed. rank', rank, 'saved', file=sys.stderr, flush=True)\n"
        "    ctypes.CDLL('libstdc++.so.6')._ZSt9terminatev()  # std::terminate()\n"))
    proc = ftb("run", str(job), timeout=180)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert f"rank {local_rank}, local rank {local_rank}; killed by SIGABRT" in out, out
    summary = out[out.index("failed: host"):]
    assert "ChildFailedError" not in summary and "its own traceback" not in summary, summary
    if local_rank:
        assert f"its last 2 line(s) on stderr ({tmp_path}/.shared/runs/" in summary, summary
    else:
        assert "line(s) before torchrun's report, in " in summary and "node-0-localhost.a1.log:" in summary, summary
    assert f"| Training completed. rank {local_rank} saved" in summary, summary
    assert "| terminate called without an active exception" in summary, summary
    assert "hint: the rank aborted in native code (std::terminate)" in summary, summary
    run_dir = next((tmp_path / ".shared/runs").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["failure"]["line"] == \
        f"exited with code 1; rank {local_rank} (local rank {local_rank}): killed by SIGABRT"


def test_llamafactory_failure_comes_from_the_torch_elastic_error_file(tmp_path, tiny_model):  # noqa: F811
    missing = quickstart_copy(tmp_path / "missing", tiny_model, model_name_or_path=str(tmp_path / "no-such-model"))
    refused = ftb("run", str(missing), timeout=300)  # a model path on no host: refused by the check
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"model_name_or_path {tmp_path}/no-such-model on localhost: No such file or directory" in refused.stdout
    (tmp_path / "empty-model").mkdir()  # there, but no model in it: the ranks fail loading it
    job = quickstart_copy(tmp_path, tiny_model, model_name_or_path=str(tmp_path / "empty-model"))
    proc = ftb("run", str(job), timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out
    summary = out[out.index("failed: host"):]
    assert "its own traceback (torch elastic error file):" in summary, out
    failure = "ValueError: Couldn't instantiate the backend tokenizer"  # transformers 5.6, a directory with no model
    assert failure in summary and "ChildFailedError" not in summary
    run_dir = next((tmp_path / "quickstart/.shared/runs").iterdir())
    errors = list((run_dir / "ranks/node-0").glob("*/attempt_0/*/error.json"))
    assert errors and failure in errors[0].read_text()
