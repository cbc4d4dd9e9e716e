"""The user-facing pieces without training: progress parsing, the plain display, summaries
and hints, run history from files, `ftbundle init` (its result passes --dry-run), and
shell completion."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import yaml

from ftbundle.cli import main
from ftbundle.history import format_runs, run_row, run_summary, split_tail_output
from ftbundle.launch.failure import RankFailure, cause_line, parse_root_cause
from ftbundle.ui.phases import Phases, warning_key
from ftbundle.ui.progress import Progress, parse_bar, parse_hf_dict, parse_trainer_log, status_line
from ftbundle.ui.summary import (before_torchrun_report, closing_summary, describe_exit, failure_summary, hint,
                                 last_words, parse_error_file, traceback_from_stderr)
from tests.support.helpers import free_port

RECORD = ('{"current_steps": 30, "total_steps": 60, "loss": 5.9, "lr": 0.0025, "epoch": 1.3, '
          '"percentage": 50.0, "elapsed_time": "0:00:12", "remaining_time": "0:00:12"}')


def test_trainer_log_record_drives_the_status_line():
    p = Progress(effective_batch=8, from_jsonl=True)
    p.feed_record(parse_trainer_log(RECORD))
    line = status_line(p, alive=4, total_nodes=4)
    assert "step 30/60" in line and "epoch 1.30" in line and "loss 5.9000" in line
    assert "lr 2.50e-03" in line and "samples/s 20.0" in line  # 30 steps x 8 samples / 12 s
    assert "eta 00:12" in line and "nodes 4/4" in line
    # stdout dicts do not override the trainer log in LlamaFactory mode
    p.feed_line("{'loss': 1.0, 'learning_rate': 0.1, 'epoch': 9.0}")
    assert p.loss == 5.9 and p.records == [{"current_steps": 30, "total_steps": 60, "loss": 5.9, "lr": 0.0025,
                                            "epoch": 1.3}]
    assert parse_trainer_log("not json") is None and parse_trainer_log('{"a": 1}') is None


def test_script_mode_reads_hf_dicts_and_the_trainer_bar():
    p = Progress()
    assert parse_bar("Running tokenizer on dataset: 100%|####| 21/21 [00:00<00:00]") is None
    assert p.feed_line(" 35%|###5      | 21/60 [00:03<00:06,  6.2it/s]")
    assert (p.step, p.total) == (21, 60)
    assert p.feed_line("{'loss': 2.0, 'grad_norm': 1.5, 'learning_rate': 0.001, 'epoch': 0.5}")
    assert p.feed_line("{'loss': 1.0, 'grad_norm': 1.5, 'learning_rate': 0.0009, 'epoch': 0.6}")
    assert p.loss == 1.0 and p.lr == 0.0009
    # the live line shows the last loss logged, the figure the summary ends with (issue 45: it showed a
    # smoothed loss, unlabelled, that disagreed with the summary's)
    assert "loss 1.0000" in status_line(p, alive=1, total_nodes=1) and p.final_loss == 1.0
    assert p.feed_line("  train_samples_per_second =    143.496")
    assert p.samples_per_s == 143.496
    assert not p.feed_line("some other line") and p.last_line == "some other line"
    assert parse_hf_dict("x {'loss': oops}") is None


def test_plain_display_has_no_carriage_returns_and_one_line_per_step_and_interval():
    out = io.StringIO()
    ui = Phases(out, tty=False, nnodes=2)
    ui.checking(0, 2)
    ui.checking(2, 2)
    ui.staging()
    ui.launching(0, 2)
    ui.launching(2, 2)
    p = Progress(from_jsonl=True)
    ui.training(p, 2)
    for step in range(1, 61):
        p.feed_record(json.loads(RECORD.replace('"current_steps": 30', f'"current_steps": {step}')))
        ui.training(p, 2)
    ui.final_progress()
    for _ in range(3):
        ui.warning("[WARNING|2026-11-23 12:31:29] parser:149 >> We recommend enable mixed precision training.")
    ui.done(["finished"])
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    progress_lines = [line for line in lines if line.startswith("ftbundle: training: step")]
    # the first step, then nothing for PLAIN_EVERY_S, then the last step: not one line per step
    assert [line.split()[3] for line in progress_lines] == ["1/60", "60/60"], lines
    assert sum("mixed precision" in line for line in lines) == 1
    assert lines[0] == "ftbundle: checking 2 host(s)" and lines[-1] == "finished"
    assert warning_key("a line") is None


def test_rich_display_draws_the_live_line_on_a_terminal():
    out = io.StringIO()
    ui = Phases(out, tty=True, nnodes=2)
    p = Progress(from_jsonl=True)
    ui.launching(2, 2)
    ui.training(p, 2)
    p.feed_record(parse_trainer_log(RECORD))
    ui.training(p, 2)
    ui._live.refresh()
    ui.done(["finished run r1"])
    text = out.getvalue()
    assert "training" in text and "30/60" in text and "loss" in text and "nodes" in text and "2/2" in text
    assert text.rstrip().endswith("finished run r1")


def test_closing_summary_names_steps_loss_throughput_and_paths():
    p = Progress(from_jsonl=True)
    p.feed_record(parse_trainer_log(RECORD.replace('"current_steps": 30', '"current_steps": 60')))
    p.samples_per_s = 143.5  # the trainer's closing figure, for all 60 steps
    lines = closing_summary(run_id="r1", run_dir="/s/runs/r1", duration_s=75, progress=p, output_dir="/s/out",
                            adapter="/s/out/adapter_model.safetensors", nnodes=2)
    text = "\n".join(lines)
    assert "finished run r1 on 2 node(s) in 01:15" in text and "steps        60/60" in text
    assert "final loss   5.9000" in text and "143.5 samples/s" in text
    assert "/s/out/adapter_model.safetensors" in text and "run dir      /s/runs/r1" in text


def test_hints_for_common_causes():
    assert "OOM" in hint(137, "") and "OOM" in hint(-9, "")
    assert "collective timed out" in hint(1, "RuntimeError: [../gloo/transport/tcp/pair.cc] Timed out waiting 30000ms for gloo")
    assert "port is in use" in hint(1, "RuntimeError: The server socket has failed to listen: Address already in use")
    assert "dataset" in hint(1, "FileNotFoundError: [Errno 2] No such file or directory: 'data/support.json'")
    assert hint(1, "ValueError: boom") is None
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(137) == "exit code 137 (SIGKILL)"


ROOT_CAUSE = """[localhost r0] torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
[localhost r0] ============================================================
[localhost r0] Root Cause (first observed failure):
[localhost r0] [0]:
[localhost r0]   time      : 2026-11-23_12:38:40
[localhost r0]   host      : box
[localhost r0]   rank      : 3 (local_rank: 1)
[localhost r0]   exitcode  : -9 (pid: 4242)
[localhost r0]   error_file: <N/A>
[localhost r0]   traceback : Signal 9 (SIGKILL) received by PID 4242"""


def test_failure_summary_from_torchrun_root_cause_and_error_file():
    found = parse_root_cause(ROOT_CAUSE.splitlines())
    assert (found.global_rank, found.local_rank, found.code, found.error_file) == (3, 1, -9, None)
    error = parse_error_file(json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom",
        "timestamp": "1700000000"}}}), local_rank=1)
    assert error.traceback.endswith("ValueError: boom") and error.timestamp == 1700000000
    lines = failure_summary(host="node1", address="10.0.0.2", node_rank=1, reason="exited with code 1", code=1,
                            rank_error=error, rank_traceback=None, tail=["ChildFailedError"], log_path="/l",
                            local_rank=1, global_rank=3)
    text = "\n".join(lines)
    assert "host node1 (10.0.0.2), node rank 1, rank 3, local rank 1; exit code 1" in text
    assert "  ValueError: boom" in text and "ChildFailedError" not in text
    oom = failure_summary(host="n", address="a", node_rank=0, reason="r", code=-9, rank_error=None,
                          rank_traceback=None, tail=["x"], log_path="/l")
    assert "killed by SIGKILL" in oom[0] and any(line.startswith("hint: killed with SIGKILL") for line in oom)
    # a full disk: the file that could not be written and its host are named (issue 46 item 4)
    full = failure_summary(host="node1", address="a", node_rank=1, reason="r", code=1, rank_error=None,
                           rank_traceback="Traceback (most recent call last):\n  File \"t.py\"\nOSError: [Errno 28] "
                           "No space left on device: '/local/out/checkpoint-40/optimizer.pt'", tail=None, log_path="/l")
    assert ("hint: no space left on the disk of /local/out/checkpoint-40/optimizer.pt on node1 (ENOSPC): free space "
            "under the shared directory (logs, checkpoints) or the output_dir; a rank's log may be cut") in full, full
    bare = failure_summary(host="node1", address="a", node_rank=1, reason="r", code=1, rank_error=None,
                           rank_traceback=None, tail=["bash: echo: write error: No space left on device"], log_path="/l")
    assert any(line.startswith("hint: the disk is full (ENOSPC) where the rank or ftbundle writes") for line in bare)
    assert traceback_from_stderr("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"b.py\"\n"
                                 "[rank1]: ValueError: x\nafter") == ("Traceback (most recent call last):\n"
                                                                     "  File \"b.py\"\nValueError: x")


def test_the_failing_rank_in_a_line_for_the_runs_record_runs_and_a_webhook():
    """torchrun exits 1 whatever its rank did: the failure's line (summary.json, `runs`, notify)
    adds the rank torchrun named, its own exit and the last line of what it raised."""
    killed = parse_root_cause(ROOT_CAUSE.splitlines())
    assert cause_line(killed, 1) == "rank 3 (local rank 1): killed by SIGKILL"
    raised = RankFailure(global_rank=1, local_rank=1, code=1, error=parse_error_file(json.dumps(
        {"message": {"message": "ValueError: bad\n   batch", "extraInfo": {"py_callstack": "T", "timestamp": 1}}})))
    assert cause_line(raised, 1) == "rank 1 (local rank 1): exit code 1; ValueError: bad batch"
    from_stderr = RankFailure(global_rank=0, local_rank=0, code=None, traceback="Traceback (most recent call last):\n"
                              "  File \"t.py\"\nRuntimeError: " + "x" * 300 + "\n\n")
    line = cause_line(from_stderr, 7)
    assert line.startswith("rank 0 (local rank 0): exit code 7; RuntimeError: xxx") and line.endswith("...")
    assert len(line) == len("rank 0 (local rank 0): exit code 7; ") + 200, line
    assert cause_line(RankFailure(code=3), 3) is None  # (torchrun named no rank: the node's reason says enough)


NODE_LOG_ABORT = """[INFO|trainer.py:3815] 2026-11-23 18:51:56,293 >> Saving model checkpoint to /s/output/lora
  train_runtime            = 0:00:00.97
terminate called without an active exception
Fatal Python error: Aborted
W1123 18:51:57.529000 67 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 74 closing signal SIGTERM
Traceback (most recent call last):
  File "/v/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
[0]:
  rank      : 4 (local_rank: 0)
  exitcode  : -6 (pid: 73)"""


def test_torchruns_own_traceback_is_never_taken_for_the_ranks():
    """CI's node log of a rank that aborted at exit: torchrun's ChildFailedError traceback is
    the agent's; what the rank said last comes before torchrun's report."""
    lines = NODE_LOG_ABORT.splitlines()
    assert traceback_from_stderr(NODE_LOG_ABORT) is None
    rank_tb = "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: x\n"
    assert traceback_from_stderr(rank_tb + NODE_LOG_ABORT).endswith("ValueError: x")
    said = before_torchrun_report(lines)
    assert last_words("\n".join(said), 3) == ["  train_runtime            = 0:00:00.97",
                                               "terminate called without an active exception",
                                               "Fatal Python error: Aborted"]
    assert before_torchrun_report(["just a command's output"]) is None
    assert "std::terminate" in hint(-6, "\n".join(said))
    lines = failure_summary(host="node2", address="a", node_rank=2, reason="exited with code 1", code=-6,
                            rank_error=None, rank_traceback=None, tail=lines[-3:], log_path="/l",
                            local_rank=0, global_rank=4, rank_last_words=(None, last_words("\n".join(said))))
    text = "\n".join(lines)
    assert "its last 4 line(s) before torchrun's report, in /l:" in text and "ChildFailedError" not in text
    assert "  | terminate called without an active exception" in text and "killed by SIGABRT" in lines[0]


def test_a_stalled_run_is_recorded_and_listed_as_stalled_not_failed():
    """The stall watchdog's stop (exit 124) is its own state in summary.json and `ftbundle
    runs`; a job that exits 124 by itself (a `timeout` inside it) is a plain failure."""
    from types import SimpleNamespace

    plan = SimpleNamespace(run_id="j-20261124-230000-abcd", job_name="j", nodes=[], nproc_per_node=2,
                           checkpoint_dir=None)
    common = dict(interrupted=False, attempt=1, started=0.0, duration_s=3.0, progress=Progress(), failed_host="b")
    stalled = run_summary(plan, exit_code=124, stalled=True, **common)
    own_124 = run_summary(plan, exit_code=124, **common)
    assert (stalled["state"], own_124["state"]) == ("stalled", "failed")
    row = run_row(plan.run_id, {"plan.json": json.dumps({"job": "j", "nodes": [{"host": "a"}]}),
                                "summary.json": json.dumps(stalled)})
    assert (row.state, row.exit_code) == ("stalled", 124)
    assert "stalled" in format_runs([row]).splitlines()[1]


def test_run_history_rows_from_files():
    plan = json.dumps({"job": "j", "checkpoint_dir": "/s/out", "nodes": [{"host": "a"}, {"host": "b"}]})
    done = run_row("j-20261123-120000-abcd", {"plan.json": plan, "summary.json": json.dumps(
        {"state": "finished", "exit_code": 0, "duration_s": 61.0, "final_loss": 1.25, "started": 0})})
    failed = run_row("j-20261123-130000-abcd", {"plan.json": plan, "attempt": "2\n", "node-0.a2.exit": "0\n",
                                                "node-1.a2.exit": "137\n"})
    running = run_row("j-20261123-140000-abcd", {"plan.json": plan, "node-0.a1.exit": "0\n"})
    assert (done.state, done.exit_code, done.final_loss, done.hosts) == ("finished", 0, 1.25, ["a", "b"])
    assert (failed.state, failed.exit_code, failed.start) == ("failed", 137, "2026-11-23T13:00:00")
    assert running.state == "running?" and run_row("x", {}) is None
    table = format_runs([done, failed]).splitlines()
    assert table[0].split()[:3] == ["RUN", "HOSTS", "START"] and "1:01" in table[1] and "1.2500" in table[1]
    tail = "==> /s/runs/r1/plan.json <==\n{}\n\n==> /s/runs/r1/node-0.a1.exit <==\n0\n"
    assert split_tail_output(tail, "/s/runs") == {"r1": {"plan.json": "{}\n", "node-0.a1.exit": "0\n"}}


def test_init_writes_a_job_that_passes_dry_run(tmp_path, capsys):
    target = tmp_path / "proj"
    assert main(["init", "--dir", str(target), "--hosts", "gpu1,gpu2", "--gpus", "4", "--model", "org/model",
                 "--mode", "qlora", "--yes"]) == 0
    train = yaml.safe_load((target / "train.yaml").read_text())
    assert train["quantization_bit"] == 4 and train["finetuning_type"] == "lora"
    assert "= 4 x 4 x 4 x 2 = 128" in (target / "train.yaml").read_text()  # effective batch, explained
    assert yaml.safe_load((target / "inventory.yml").read_text())["all"]["children"]["trainers"]["hosts"].keys() \
        == {"gpu1", "gpu2"}
    # the servers run the image site.yml pins (nothing names an interpreter no role installs);
    # what only the user knows is a commented placeholder naming where it is documented
    job = yaml.safe_load((target / "job.yaml").read_text())
    assert job["runtime"] == {"kind": "docker", "gpus": "all"} and "python" not in job["runtime"]
    inventory_text = (target / "inventory.yml").read_text()
    for placeholder in ("# ftb_image: ", "# ftb_training_user: ", "# ansible_user: ", "# gpu1:"):
        [line] = [i for i, text in enumerate(inventory_text.splitlines()) if text.strip().startswith(placeholder)]
        assert "FILL IN" in "".join(inventory_text.splitlines()[line - 3:line]), placeholder
    assert "docs/quickstart-servers.md#the-training-image" in inventory_text
    assert "docs/provisioning.md#an-external-nfs-server" in inventory_text
    capsys.readouterr()
    # filled in as the newcomer does: the image's digest, then --dry-run needs no host
    digest = "registry.example.com/ml/train@sha256:" + "1" * 64
    (target / "inventory.yml").write_text(inventory_text.replace(
        "# ftb_image: registry.example.com/ml/train@sha256:<the 64 hex digits of its digest>", f"ftb_image: {digest}"))
    assert main(["run", str(target / "job.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world size 8 = 2 node(s) x 4 rank(s); master gpu1:29500" in out
    assert "effective batch size 128" in out
    # again without --force: refused, nothing overwritten
    assert main(["init", "--dir", str(target), "--yes"]) == 2


def test_init_gpus_0_makes_a_cpu_job_for_servers(tmp_path, capsys):
    """`--gpus 0` was refused, and the job init wrote said bf16: true: LlamaFactory then
    stopped on every host. A CPU job: gpus_per_node 0, use_cpu, gloo, no half precision."""
    target = tmp_path / "cpu"
    assert main(["init", "--dir", str(target), "--hosts", "a,b", "--gpus", "0", "--model", "/shared/ftbundle/m",
                 "--yes"]) == 0
    job = yaml.safe_load((target / "job.yaml").read_text())
    train = yaml.safe_load((target / "train.yaml").read_text())
    assert job["gpus_per_node"] == 0 and job["nproc_per_node"] == 1 and job["runtime"] == {"kind": "docker"}
    assert job["env"]["HF_HUB_OFFLINE"] == 1  # a model given as a path: no hub
    assert train["use_cpu"] is True and train["ddp_backend"] == "gloo"
    assert not {"bf16", "fp16"} & set(train)
    # its example trains and logs as written: a batch that fits the 3 example samples, every step logged
    assert "= 1 x 1 x 1 x 2 = 2" in (target / "train.yaml").read_text() and train["logging_steps"] == 1
    assert len(json.loads((target / "data" / "example.json").read_text())) >= 2
    out = capsys.readouterr().out
    assert "FILL IN" in out and "ansible-playbook site.yml -i" in out  # the next steps, in order
    assert main(["init", "--dir", str(tmp_path / "neg"), "--gpus", "-1", "--yes"]) == 2
    assert "key '--gpus': must be 0 (a CPU job" in capsys.readouterr().err


def test_init_without_flags_or_terminal_takes_defaults(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "init", "--dir", str(tmp_path / "d")],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load((tmp_path / "d/job.yaml").read_text())
    assert job["nproc_per_node"] == 2 and "inventory" not in job
    assert yaml.safe_load((tmp_path / "d/train.yaml").read_text())["use_cpu"] is True
    assert main(["run", str(tmp_path / "d/job.yaml"), "--dry-run"]) == 0


def test_completion_and_help_examples(capsys):
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "complete -o filenames -F _ftbundle ftbundle" in script
    assert "run) opts=" in script and "--dry-run" in script and "--verbose" in script and "plot) opts=" in script
    proc = subprocess.run(["bash", "-c", script + "\nCOMP_WORDS=(ftbundle ru); COMP_CWORD=1; _ftbundle; "
                           "echo ${COMPREPLY[@]}; COMP_WORDS=(ftbundle run --dr); COMP_CWORD=2; _ftbundle; "
                           "echo ${COMPREPLY[@]}"], capture_output=True, text=True)
    assert proc.stdout.split("\n")[:2] == ["run runs", "--dry-run"], proc.stdout + proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "ftbundle", "--help"], capture_output=True, text=True).stdout
    assert "examples:" in help_text and "ftbundle plot job.yaml -o loss.png" in help_text


def test_run_files_are_read_through_a_host_in_one_round_trip(tmp_path):
    """The path taken when the shared storage is not mounted here: find + tail on the host
    (here a local one, so the real commands run), split back into files."""
    from ftbundle.cluster import Cluster
    from ftbundle.history import read_run_files
    from ftbundle.inventory import localhost_only

    for run, code in (("j-20261123-120000-aaaa", "0"), ("j-20261123-130000-bbbb", "3")):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "plan.json").write_text('{"job": "j", "nodes": [{"host": "h"}]}\n')
        (tmp_path / "runs" / run / "node-0.a1.exit").write_text(code + "\n")
        (tmp_path / "runs" / run / "node-0-h.a1.log").write_text("not asked for\n")
    host = localhost_only()[0]
    with Cluster([host]).open() as cluster:
        remote = read_run_files(cluster, host, str(tmp_path / "runs"), ("plan.json", "*.exit"), here=False)
    local = read_run_files(None, None, str(tmp_path / "runs"), ("plan.json", "*.exit"))
    assert remote == local
    assert remote["j-20261123-130000-bbbb"]["node-0.a1.exit"] == "3\n"
    assert run_row("j-20261123-130000-bbbb", remote["j-20261123-130000-bbbb"]).state == "failed"


def test_init_on_a_terminal_asks_and_takes_the_answers(tmp_path):
    """On a terminal (a real pty), init asks for hosts, GPUs, model and method, offers the
    defaults, asks again after an answer that is not valid, and writes what was answered."""
    import os
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "init", "--dir", str(tmp_path / "p")],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = b""

    def until(text: bytes, timeout: float = 30) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break

    try:
        for prompt, answer in [(b"hosts (comma-separated; empty: this machine) []: ", b"gpu1, gpu2"),
                               (b"GPUs per host (0: a CPU job) [8]: ", b"many"), (b"not valid: 'many'", b""),
                               (b"GPUs per host (0: a CPU job) [8]: ", b"4"),
                               (b"model (path or hub id) [", b""), (b"method (lora, qlora, full) [lora]: ", b"full")]:
            until(prompt)
            seen = seen.split(prompt, 1)[1]
            if answer or prompt.startswith(b"model"):
                os.write(master, answer + b"\n")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(master)
    job = yaml.safe_load((tmp_path / "p/job.yaml").read_text())
    assert job["nproc_per_node"] == 4
    assert yaml.safe_load((tmp_path / "p/inventory.yml").read_text())["all"]["children"]["trainers"]["hosts"].keys() \
        == {"gpu1", "gpu2"}
    assert yaml.safe_load((tmp_path / "p/train.yaml").read_text())["finetuning_type"] == "full"


# Lines of rank 0's output before the first step, as LlamaFactory 0.9.5 and transformers 5.6
# printed them in a real quickstart run (2 CPU ranks; copied from its node log).
REAL_START = """\
[INFO|2026-11-24 22:40:13] llamafactory.hparams.parser:144 >> Set `ddp_find_unused_parameters` to False in DDP training since LoRA is enabled.
[INFO|2026-11-24 22:40:13] llamafactory.hparams.parser:523 >> Process rank: 0, world size: 2, device: cpu:0, distributed training: True, compute dtype: None
[INFO|configuration_utils.py:769] 2026-11-24 22:40:13,671 >> loading configuration file /tmp/w24q/qs/.shared/tiny-llama/config.json
[INFO|2026-11-24 22:40:13] llamafactory.data.loader:144 >> Loading dataset support.json...
Generating train split: 184 examples [00:00, 13021.83 examples/s]
Converting format of dataset: 100%|██████████| 184/184 [00:00<00:00, 7372.98 examples/s]
Running tokenizer on dataset: 100%|██████████| 184/184 [00:00<00:00, 1603.43 examples/s]
training example:
[INFO|modeling_utils.py:748] 2026-11-24 22:40:15,065 >> loading weights file /tmp/w24q/qs/.shared/tiny-llama/model.safetensors
Loading weights: 100%|██████████| 21/21 [00:00<00:00, 10052.54it/s]
[INFO|2026-11-24 22:40:15] llamafactory.model.adapter:144 >> Fine-tuning method: LoRA
[INFO|2026-11-24 22:40:15] llamafactory.model.loader:144 >> trainable params: 23,552 || all params: 220,480 || trainable%: 10.6821
[INFO|trainer.py:1469] 2026-11-24 22:40:17,803 >> ***** Running training *****
  2%|▏         | 1/60 [00:00<00:10,  5.43it/s]
"""


def test_the_stages_before_the_first_step_come_from_what_the_ranks_print():
    from ftbundle.ui import Phases, Progress

    p = Progress()
    out = io.StringIO()
    ui = Phases(out, tty=False, nnodes=1)
    ui.training(p, alive=1)
    stages = []
    for line in REAL_START.splitlines():
        p.feed_line(line)
        ui.training(p, alive=1)
        if p.stage and (not stages or stages[-1] != p.stage):
            stages.append(p.stage)
    assert stages == ["waiting for ranks", "loading tokenizer (2 ranks connected)", "loading dataset",
                      "tokenizing dataset", "loading model", "preparing the model (LoRA)", "starting the first step"]
    assert p.step == 1 and p.total == 60
    said = [line for line in out.getvalue().splitlines() if line.startswith("ftbundle: training: ")]
    assert said[0] == "ftbundle: training: ranks starting", said
    assert said[1].startswith("ftbundle: training: waiting for ranks  (") and said[1].endswith(" s since launch)")
    assert said[2].startswith("ftbundle: training: loading tokenizer (2 ranks connected)  (waiting for ranks: "), said
    # once the first step is seen: where the time before it went, part by part
    [startup] = [line for line in out.getvalue().splitlines() if line.startswith("ftbundle: before the first step ")]
    for part in ("launch and start-up", "waiting for ranks", "loading tokenizer", "loading dataset",
                 "tokenizing dataset", "loading model", "preparing the model"):
        assert f", {part} " in startup or f": {part} " in startup, (part, startup)
    assert not any("llamafactory" in line or "INFO" in line for line in out.getvalue().splitlines())


def test_many_unreachable_hosts_are_folded_by_reason():
    """Past 3 hosts that cannot be connected, the error folds them by reason (1,024 hosts'
    own lines made one line of 100 KB); up to 3, each host's own line with its address."""
    from ftbundle.cluster import Cluster
    from ftbundle.inventory import Host

    port = free_port()  # (nothing listens on it: refused at once)
    hosts = [Host(name=f"gpu-{i:03d}", address="127.0.0.1", port=port, user="root") for i in range(1, 7)]
    cluster = Cluster(hosts, connect_tries=1)
    cluster.open()
    said = cluster.errors_said()
    assert said.startswith("6 hosts: gpu-[001-006]: "), said
    assert "refused" in said.lower() and said.count("127.0.0.1") == 0, said
    few = Cluster(hosts[:2], connect_tries=1)
    few.open()
    assert few.errors_said().count(f"root@127.0.0.1:{port}") == 2, few.errors_said()


def test_inits_site_command_reads_the_projects_ansible_cfg_from_wherever_it_is_run(tmp_path):
    """README said `cd myjob; ansible-playbook ../site.yml`: Ansible reads ansible.cfg from the
    working directory only, so every run warned of discovered interpreters and ran 5 forks. The
    command init prints names the checkout's ansible.cfg when the user is elsewhere, and the
    Ansible it starts does read it (forks 16)."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from ftbundle.init import provision_command
    from tests.support.helpers import REPO

    assert provision_command("myjob/inventory.yml", cwd=REPO) == "ansible-playbook site.yml -i myjob/inventory.yml"
    command = provision_command("myjob/inventory.yml", cwd=tmp_path)
    assert command == (f"ANSIBLE_CONFIG={REPO / 'ansible.cfg'} ansible-playbook {REPO / 'site.yml'} "
                       "-i myjob/inventory.yml")
    assignment = shlex.split(command)[0]
    bindir = Path(sys.executable).parent
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    dump = [str(bindir / "ansible-config"), "dump", "--only-changed"]
    name, _, value = assignment.partition("=")
    read = subprocess.run(dump, cwd=tmp_path, env={**env, name: value}, capture_output=True, text=True, timeout=60)
    plain = subprocess.run(dump, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert f"DEFAULT_FORKS({REPO / 'ansible.cfg'}) = 16" in read.stdout, read.stdout + read.stderr
    assert "DEFAULT_FORKS" not in plain.stdout  # the check can fail: from elsewhere, Ansible's default


def test_the_summarys_samples_per_second_says_why_it_is_not_the_trainers_own():
    """A resumed attempt's trainer counts its whole schedule in train_samples_per_second; ftbundle's
    figure counts the steps this attempt made. Both were on screen (logs and runs), unexplained."""
    from ftbundle.ui.summary import closing_summary

    p = Progress(start_step=10)
    p.feed_record({"current_steps": 20, "total_steps": 20, "loss": 1.5})
    p.feed_line("  train_samples_per_second =     56.67")
    lines = closing_summary(run_id="r", run_dir="/r", duration_s=30.0, progress=p, output_dir=None, adapter=None,
                            nnodes=2)
    [said] = [line for line in lines if line.startswith("  throughput")]
    assert said == ("  throughput   28.3 samples/s (over the 10 step(s) this attempt made; the trainer's own "
                    "train_samples_per_second 56.67, in the logs, counts all 20 of its schedule over this attempt's "
                    "time)"), said
    fresh = Progress()
    fresh.feed_record({"current_steps": 20, "total_steps": 20, "loss": 1.5})
    fresh.feed_line("  train_samples_per_second =     56.67")
    [plain] = [line for line in closing_summary(run_id="r", run_dir="/r", duration_s=30.0, progress=fresh,
                                                output_dir=None, adapter=None, nnodes=2) if "throughput" in line]
    assert plain == "  throughput   56.7 samples/s"  # the same figure: nothing to explain
