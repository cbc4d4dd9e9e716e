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
from ftbundle.ui.phases import _WARNING, Phases, warning_key
from ftbundle.ui.progress import _STAGES, Progress, stage_of

DATA = Path(__file__).parent / "data" / "llamafactory"


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
    """A line goes to the warning pattern only if it holds "warn" in some case: the same
    verdict as the pattern alone, on a real log and on any case of the word."""
    lines = recorded() + ["[WARNING|x] y", "a wArN b", "Warn: z", "warn", "xwarn", "warned", "no", "W1127 torch"]
    assert [warning_key(line) is None for line in lines] == [not _WARNING.search(line) for line in lines]
    assert warning_key("[WARNING|2026-11-27 07:39:44] p:149 >> a") == "[WARNING|# #] p:# >> a"
    assert warning_key("000012345 " + "x" * 89) is None


def bare_supervisor(nnodes: int) -> Supervisor:
    """The supervisor's node states and what it shows, without a cluster."""
    sup = Supervisor.__new__(Supervisor)
    sup.plan = SimpleNamespace(nodes=[SimpleNamespace(host=SimpleNamespace(name=f"node{i}")) for i in range(nnodes)],
                               checkpoint_dir=None)
    sup.status = [NodeStatus() for _ in range(nnodes)]
    sup._running = 0
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
    assert said[:3] == ["ftbundle: training: ranks starting", "ftbundle: training: waiting for ranks",
                        "ftbundle: training: loading tokenizer (1 ranks connected)"]
    assert said[-1] == "ftbundle: training: starting the first step" and len(said) == len(set(said))
