"""Rank 0's output as the default display reads it (no -v): recorded LlamaFactory output
(tests/data/llamafactory) through the runner's line splitter and the progress feed, and
what of it reaches the terminal; and what the feed costs per line of a chatty rank 0."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from ftbundle.launch.display import ProgressFeed
from ftbundle.launch.node import Event, LineSplitter
from ftbundle.launch.supervisor import NodeStatus, State, Supervisor
from ftbundle.ui.phases import _PY_WARNING, _WARNING, Phases, _text, warning_key
from ftbundle.ui.progress import _STAGES, Progress, stage_of

DATA = Path(__file__).parents[1] / "data" / "llamafactory"


def recorded(name: str = "cpu-3steps.node-0.log") -> list[str]:
    """A recorded node log as the runner hands it on, line by line (a bar's redraws reduced
    to their last state, as on a terminal)."""
    lines: list[str] = []
    splitter = LineSplitter(lines.append, lambda bar: None)
    splitter.feed((DATA / name).read_bytes())
    splitter.close()
    return lines


def stage_by_regex_alone(line: str) -> str | None:
    for _, pattern, text in _STAGES:
        match = pattern.search(line)
        if match:
            return text.format(*match.groups())
    return None


def test_stage_words_let_through_every_line_a_stage_pattern_matches():
    """The substring test before the stage patterns hides no stage: on a real LlamaFactory
    log, and on a line for every alternative of every pattern."""
    made_up = ["[INFO|modeling_utils.py:1] >> loading weights file m.safetensors", "Loading weights: 5%|",
               "Loading checkpoint shards: 100%|##| 2/2", "Instantiating LlamaForCausalLM model under default dtype",
               "Generating train split: 3 examples", "Converting format of dataset: 100%|", "x Loading dataset a.json",
               "***** Running training *****", "Fine-tuning method: Freeze", "Process rank: 3, world size: 8, device",
               "Running tokenizer on dataset (num_proc=4):   0%|", "llamafactory.hparams.parser:144 >> x",
               "a line of no stage", "Loading", "Running training without stars"]
    lines = recorded() + made_up
    assert [stage_of(line) for line in lines] == [stage_by_regex_alone(line) for line in lines]
    seen = []
    for line in recorded():
        stage = stage_of(line)
        if stage and (not seen or seen[-1] != stage):
            seen.append(stage)
    assert seen[:2] == ["waiting for ranks", "loading tokenizer (1 ranks connected)"]
    assert seen[-3:] == ["loading model", "preparing the model (LoRA)", "starting the first step"], seen


def test_the_warning_substring_test_hides_no_warning():
    """A line goes to the warning patterns only if it holds "warn" in some case: no line
    without it can match them, on a real log or in any case of the word."""
    lines = recorded() + ["[WARNING|x] y", "a wArN b", "Warn: z", "warn", "xwarn", "warned", "no", "W1127 torch",
                          "x.py:3: UserWarning: y", "x.py:3: DeprecationWARNING: y"]
    for line in lines:
        if "warn" not in line.lower():
            assert not _WARNING.search(line) and not _PY_WARNING.search(line) and warning_key(line) is None
        elif _WARNING.search(line) or _PY_WARNING.search(line):
            assert warning_key(line) is not None or _text(line).startswith(" ")
    assert warning_key("[WARNING|2026-11-27 07:39:44] p:149 >> a") == "[WARNING|# #] p:# >> a"
    assert warning_key("000012345 " + "x" * 89) is None


def bare_supervisor(nnodes: int) -> Supervisor:
    """The supervisor's node states and what it shows, without a cluster."""
    sup = Supervisor.__new__(Supervisor)
    sup.plan = SimpleNamespace(nodes=[SimpleNamespace(host=SimpleNamespace(name=f"node{i}")) for i in range(nnodes)],
                               checkpoint_dir=None)
    sup.status = [NodeStatus() for _ in range(nnodes)]
    sup._running = sup._finished = 0
    sup.marks = {}
    sup.failures = []
    sup.runners = [SimpleNamespace(drop=lambda: None) for _ in range(nnodes)]
    sup.display = None
    sup.ui = None
    sup.progress = Progress()
    return sup


def test_the_count_of_running_nodes_follows_every_change_of_state():
    """Kept as states change (read on every progress update), never recounted per line."""
    sup = bare_supervisor(3)

    def recount() -> int:
        return sum(st.state is State.RUNNING for st in sup.status)

    events = [Event("pid", 0, "11"), Event("pid", 1, "12"), Event("pid", 1, "12"), Event("pid", 2, "13"),
              Event("exit", 0, code=0), Event("lost", 2, "cut"), Event("pid", 2, "13"), Event("exit", 1, code=0),
              Event("exit", 1, code=0)]
    counts = []
    for event in events:
        sup._handle(event)
        assert sup._alive() == recount()
        counts.append(sup._alive())
    assert counts == [1, 2, 2, 3, 2, 1, 1, 0, 0]


def test_a_chatty_rank_0_tells_the_display_only_what_changed():
    """Ten thousand lines that say nothing: the display is told at most every
    QUIET_CHANGE_S, not once a line; a stage, a step, a loss: at once."""
    calls = []
    ui = SimpleNamespace(warning=lambda text: False)
    feed = ProgressFeed(ui, Progress(), lambda: calls.append(1))
    for n in range(10000):
        feed.line(f"[node0 r0] {n:09d} " + "x" * 89)
    assert len(calls) <= 2 and feed.lines_seen == 10000
    before = len(calls)
    feed.line("[node0 r0] [INFO|2026-11-27 07:39:45] llamafactory.model.adapter:144 >> Fine-tuning method: LoRA")
    feed.line("[node0 r0]  35%|###5      | 21/60 [00:03<00:06,  6.2it/s]")
    feed.line("[node0 r0] {'loss': 2.0, 'grad_norm': 1.5, 'learning_rate': 0.001, 'epoch': 0.5}")
    assert len(calls) == before + 3
    assert (feed.state.stage, feed.state.step, feed.state.loss) == ("preparing the model (LoRA)", 21, 2.0)


def test_recorded_run_on_the_plain_display_shows_its_stages_once_each():
    out = io.StringIO()
    ui = Phases(out, tty=False, nnodes=1)
    progress = Progress(effective_batch=4, from_jsonl=True)
    ui.launching(1, 1)
    ui.training(progress, 1)
    feed = ProgressFeed(ui, progress, lambda: ui.training(progress, 1))
    for line in recorded():
        feed.line("[localhost r0] " + line)
    said = [line for line in out.getvalue().splitlines() if line.startswith("ftbundle: training: ")]
    assert said[0] == "ftbundle: training: ranks starting"
    assert said[1].startswith("ftbundle: training: waiting for ranks  (") and said[1].endswith(" s since launch)")
    # each stage says how long the one before it took
    assert said[2].startswith("ftbundle: training: loading tokenizer (1 ranks connected)  (waiting for ranks: ")
    assert said[-1].startswith("ftbundle: training: starting the first step  (preparing the model: ")
    assert len(said) == len(set(said))


def shown(lines: list[str]) -> str:
    """What the plain display prints for rank 0's lines (through the progress feed)."""
    out = io.StringIO()
    ui = Phases(out, tty=False, nnodes=1)
    progress = Progress(from_jsonl=True)
    ui.launching(1, 1)
    ui.training(progress, 1)
    feed = ProgressFeed(ui, progress, lambda: ui.training(progress, 1))
    for line in lines:
        feed.line("[localhost r0] " + line)
    return out.getvalue()


def test_a_python_warning_is_shown_by_its_text_never_by_its_source_line():
    """Python's warnings print `file:line: Category: text` and then the source line that
    warned, indented: accelerate's, recorded, is `  warnings.warn(`, which alone says nothing."""
    text = shown(recorded())
    lines = text.splitlines()
    assert ("[localhost r0] /work/main/.venv/lib/python3.11/site-packages/accelerate/state.py:271: UserWarning: "
            "OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at 2 to improve oob performance.") in lines
    assert not [line for line in lines if "warnings.warn(" in line], text
    for said in ("We recommend enable mixed precision training.", "`torch_dtype` is deprecated! Use `dtype` instead!",
                 "Setting accelerator to CPU."):
        assert sum(said in line for line in lines) == 1, (said, text)
    # the libraries' notices that nothing in the job changes are said with what they mean (issue 45)
    assert any(line.endswith("We recommend enable mixed precision training.  [ftbundle: LlamaFactory's advice when "
                             "neither bf16 nor fp16 is set: on GPUs set bf16: true (the check says whether they have "
                             "it); a CPU job trains in float32 and has nothing to change]") for line in lines), text
    assert any("`torch_dtype` is deprecated! Use `dtype` instead!  [ftbundle: said by transformers of LlamaFactory's "
               "own call, not of your config: nothing to change]" in line for line in lines), text
    assert not any("[ftbundle:" in line and "Setting accelerator" in line for line in lines)
    # torch 2.14's own (recorded): the source line after it holds "warn" too, and is not shown
    torch_warning = ["/v/torch/nn/modules/module.py:1874: FutureWarning: Using a non-full backward hook when the "
                     "forward contains multiple autograd Nodes is deprecated.",
                     "  self._maybe_warn_non_full_backward_hook(args, result, grad_fn)",
                     "x.py:3: FutureWarning: old is deprecated",
                     '  warnings.warn("old is deprecated", FutureWarning)',
                     "x.py:3: FutureWarning: old is deprecated",  # (again: shown once)
                     '  warnings.warn("old is deprecated", FutureWarning)',
                     "[rank0]:/v/accelerate/state.py:271: UserWarning: OMP_NUM_THREADS/MKL_NUM_THREADS unset",
                     "  warnings.warn(",
                     "  warnings.warn(",  # a source line with no warning before it: never alone either
                     "[WARNING|2026-11-27 07:39:44] llamafactory.hparams.parser:149 >> a warning of its own"]
    printed = [line for line in shown(torch_warning).splitlines() if line.startswith("[localhost r0]")]
    assert printed == ["[localhost r0] " + torch_warning[i] for i in (0, 2, 6, 9)], printed


def test_transformers_falling_back_to_step_order_of_checkpoints_is_said_to_be_harmless():
    """`make demo` (2026-12-04) saves its checkpoints less than a second apart and transformers
    (rotate_checkpoints, use_mtime=True) warns that mtime "may not be reliable on this filesystem":
    on shared storage a user reads it as a fault of the NFS mount. Said once, with what it means."""
    said = ("[WARNING|logging.py:340] 2026-12-04 13:45:40,993 >> mtime may not be reliable on this filesystem, "
            "falling back to numerical ordering")
    printed = [line for line in shown([said, said.replace("40,993", "41,207")]).splitlines() if "mtime" in line]
    assert printed == ["[localhost r0] " + said + "  [ftbundle: said by transformers when the checkpoints it keeps "
                       "were saved less than a second apart (a small model, or storage that keeps no times): it "
                       "keeps the newest by their step numbers instead, which is right: nothing to change]"], printed


def test_the_last_line_the_summary_and_runs_show_one_samples_per_second_and_the_final_loss():
    """The recorded run: 3 steps, shorter than its logging_steps (5), so no loss was logged;
    the trainer closed with train_loss 6.2293 and 114.98 samples/s (train_results.json). The
    last progress line, the closing summary, summary.json and `ftbundle runs` show the same
    samples/s, the loss falls back to train_loss, and the nodes that finished are said to
    have finished, not shown as `nodes 0/2`."""
    import json

    from ftbundle.history import format_runs, run_row, run_summary
    from ftbundle.ui.summary import closing_summary

    trainer = json.loads((DATA / "cpu-3steps.train_results.json").read_text())
    out = io.StringIO()
    sup = bare_supervisor(2)
    sup.ui = Phases(out, tty=False, nnodes=2)
    sup.progress = Progress(effective_batch=4, from_jsonl=True)
    feed = ProgressFeed(sup.ui, sup.progress, sup._show_progress)
    sup._handle(Event("pid", 0, "11"))
    sup._handle(Event("pid", 1, "12"))
    for line in recorded():
        feed.line("[localhost r0] " + line)
    feed.record((DATA / "cpu-3steps.trainer_log.jsonl").read_text().splitlines()[-1])
    sup._handle(Event("exit", 1, code=0))
    sup._handle(Event("exit", 0, code=0))
    sup.ui.final_progress()
    progress_lines = [line for line in out.getvalue().splitlines() if line.startswith("ftbundle: training: step")]
    last = progress_lines[-1]
    assert "step 3/3" in last and "samples/s 115.0" in last and "nodes 2/2 finished" in last, progress_lines
    assert "nodes 0/2" not in out.getvalue()

    summary = "\n".join(closing_summary(run_id="r", run_dir="/s/runs/r", duration_s=10, progress=sup.progress,
                                        output_dir="/s/out", adapter=None, nnodes=2))
    assert f"{trainer['train_samples_per_second']:.1f}" == "115.0" and "throughput   115.0 samples/s" in summary
    assert "final loss   6.2293 (train_loss" in summary, summary
    plan = SimpleNamespace(run_id="j-20261127-073936-1f53", job_name="j", nodes=sup.plan.nodes, nproc_per_node=1,
                           nprocs=[1, 1], checkpoint_dir="/s/out")
    record = run_summary(plan, exit_code=0, interrupted=False, attempt=1, started=0.0, duration_s=10.0,
                         progress=sup.progress, failed_host=None)
    assert record["final_loss"] == record["train_loss"] == 6.2293 and round(record["samples_per_s"], 1) == 115.0
    row = run_row(plan.run_id, {"plan.json": json.dumps({"job": "j", "nodes": [{"host": "node0"}, {"host": "node1"}]}),
                                "summary.json": json.dumps(record)})
    header, line = format_runs([row]).splitlines()
    assert header.split()[6:] == ["FINAL", "LOSS", "SAMPLES/S", "TOKENS/S", "PER", "RANK", "MFU", "GPU", "OUTPUT", "DIR"]
    assert line.split()[-7:] == ["6.2293", "115.0", "-", "-", "-", "-", "-"], line  # (no GPU read: a CPU run)  # (a log without token counts)


def test_samples_per_second_is_over_the_steps_this_attempt_trained():
    """One definition: before the trainer's end, steps x effective batch over the trainer's
    own clock (never over the model's loading); at its end, the trainer's figure scaled to
    this attempt's steps (a resumed attempt's trainer counts the steps before it)."""
    p = Progress(effective_batch=8, from_jsonl=True)
    p.feed_record({"current_steps": 5, "total_steps": 20, "loss": 3.0, "elapsed_time": "0:00:00"})
    assert p.throughput() is None  # the trainer's clock says 0 s: no figure yet, not one over the loading
    p.feed_record({"current_steps": 10, "total_steps": 20, "loss": 3.0, "elapsed_time": "0:00:04"})
    assert p.throughput() == 20.0  # 10 x 8 / 4 s
    p.feed_line("  train_samples_per_second =     40.5")
    assert p.throughput() == 20.25  # 40.5 for all 20 steps: 10 were made
    resumed = Progress(effective_batch=8, from_jsonl=True, start_step=10)
    resumed.feed_record({"current_steps": 20, "total_steps": 20, "loss": 2.0, "elapsed_time": "0:00:02"})
    assert resumed.throughput() == 40.0  # 10 steps x 8 / 2 s
    resumed.feed_line("{'train_runtime': '1.9', 'train_samples_per_second': '84.21', 'train_loss': '2.5'}")
    assert resumed.throughput() == 42.105 and resumed.final_loss == 2.0 and resumed.train_loss == 2.5


def test_rank0s_log_is_polled_where_tail_can_and_followed_as_before_where_not(tmp_path):
    """GNU tail polls the log with its ---disable-inotify, every 0.2 s for the progress
    display, every 0.05 s for the terminal (-v): rank 0's output then comes in a few large
    packets a poll, not one small packet a write; a tail that does not know the option is
    run without it."""
    import os
    import subprocess

    from ftbundle.launch.display import Display
    from ftbundle.launch.node import FOLLOW_LOG, follow_log_argv

    feed = ProgressFeed(SimpleNamespace(), Progress(), lambda: None)
    assert follow_log_argv("/l", "7", poll_s=feed.log_poll_s) == ["bash", "-c", FOLLOW_LOG, "ftb-log", "-n", "+1",
                                                                  "-F", "-s", "0.2", "--pid=7", "--", "/l"]
    terminal = Display(io.StringIO())
    assert follow_log_argv("/l", "7", poll_s=terminal.log_poll_s)[7:9] == ["-s", "0.05"]
    # a poll's burst at 5 MB/s (100-byte lines) fits the terminal's queue
    assert terminal.capacity >= 5e6 / 100 * terminal.log_poll_s * 2
    terminal.close()

    def run(tail_script: str) -> str:
        bin_dir = tmp_path / f"bin{len(list(tmp_path.iterdir()))}"
        bin_dir.mkdir()
        (bin_dir / "tail").write_text("#!/bin/sh\n" + tail_script)
        (bin_dir / "tail").chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        return subprocess.run(["bash", "-c", FOLLOW_LOG, "ftb-log", "-n", "+1", "-F", "--", "node-0.log"],
                              capture_output=True, text=True, env=env, check=True).stdout.strip()

    knows = 'printf "%s " "$@"\n'
    does_not = 'for a; do [ "$a" = ---disable-inotify ] && { echo "tail: unrecognized option" >&2; exit 1; }; done\n' + knows
    assert run(knows) == "---disable-inotify -n +1 -F -- node-0.log"
    assert run(does_not) == "-n +1 -F -- node-0.log"
    gnu = subprocess.run(["tail", "---disable-inotify", "--version"], capture_output=True, text=True)
    assert gnu.returncode == 0 and "GNU coreutils" in gnu.stdout  # (the test hosts' Debian tail knows it)
