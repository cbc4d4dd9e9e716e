"""What the terminal shows of rank 0 before and around its bars (issue 37 item 5, the non-GPU
parts): tqdm's carriage-return bars never reach the screen as fragments glued to a warning or a
log line, and the time before the first step is said part by part. On recorded output."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

from ftbundle.launch.display import ProgressFeed
from ftbundle.launch.node import LineSplitter, display_splitter, split_bars
from ftbundle.ui.phases import Phases
from ftbundle.ui.progress import (
    IMPORT_PART,
    LAUNCH_PART,
    Progress,
    startup_parts,
    startup_text,
)
from ftbundle.ui.summary import closing_summary

DATA = Path(__file__).parents[1] / "data" / "llamafactory"
FRAGMENT = re.compile(r"\d+%\||\d+/\d+ \[\d+:\d\d|examples \[")  # any piece of a bar


def through_display(data: bytes, chunk: int = 7, *, many: bool = True) -> tuple[str, Progress, ProgressFeed]:
    """Rank 0's bytes through the runner's splitter (as node.py wires it: a read's lines at
    once, where none is redrawn; ``many=False``: a line at a time), the progress feed and
    the plain display."""
    out = io.StringIO()
    ui = Phases(out, tty=False, nnodes=1)
    progress = Progress(from_jsonl=False)
    ui.launching(1, 1)
    ui.training(progress, 1)
    feed = ProgressFeed(ui, progress, lambda: ui.training(progress, 1))
    prefix = "[localhost r0] "
    splitter = (display_splitter(feed, prefix) if many else
                LineSplitter(lambda line: feed.line(prefix + line), lambda line: feed.progress(prefix + line)))
    for i in range(0, len(data), chunk):  # (in small pieces: a bar may end in any of them)
        splitter.feed(data[i:i + chunk])
    splitter.close()
    return out.getvalue(), progress, feed


def test_a_reads_lines_at_once_come_to_what_a_line_at_a_time_does(monkeypatch):
    """The progress feed takes a read's lines in one call and searches them once: chatty
    lines between warnings (a Python warning's source line split from it by a read's end),
    stage lines, bars, step dicts, blank lines, the recorded LlamaFactory run. In reads of
    every size, the display shows the same, and the progress ends the same, as a line at a
    time. The display's clock stands still: a plain progress line is said at most every
    PLAIN_EVERY_S, and on a loaded CI machine the 7-byte reads took longer than that between
    two steps (one more line: a difference of speed, not of reads)."""
    for module in ("ftbundle.ui.phases", "ftbundle.launch.display"):  # (the feed's redraws are timed too)
        monkeypatch.setattr(f"{module}.time", SimpleNamespace(monotonic=lambda: 1000.0))
    chatty = "".join(f"{n:09d} " + "x" * 89 + "\n" for n in range(3000)).encode()
    warning = (b"/opt/venv/lib/python3.11/site-packages/torch/cuda/amp.py:12: FutureWarning: "
               b"`torch.cuda.amp.autocast(args...)` is deprecated\n  warnings.warn(\n")
    stage = b"[INFO|2026-11-27 07:39:45] llamafactory.model.adapter:144 >> Fine-tuning method: LoRA\n"
    step = b"{'loss': 2.0, 'grad_norm': 1.5, 'learning_rate': 0.001, 'epoch': 0.5}\n"
    data = (chatty + stage + chatty + step + chatty + warning + chatty + b"\n   \n" + warning + chatty
            + (DATA / "cpu-3steps.node-0.log").read_bytes() + chatty + b"last words  \n\n")
    def timeless(text: str) -> str:  # (the display's lines say how long since launch)
        return re.sub(r"\d+(\.\d+)?\s?s\b", "#s", text)

    one, p1, f1 = through_display(data, 10_000_000, many=False)
    assert "FutureWarning" in one and p1.step > 0 and f1.lines_seen > 9000
    assert p1.stages[0][0] == "preparing the model (LoRA)" and p1.records[0]["loss"] == 2.0
    for chunk in (7, 333, 4096, 65536, 10_000_000):
        out, p, f = through_display(data, chunk)
        assert timeless(out) == timeless(one), chunk
        assert (p.stage, [s for s, _ in p.stages], p.step, p.total, p.loss, p.records, p.last_line,
                p.import_s) == (p1.stage, [s for s, _ in p1.stages], p1.step, p1.total, p1.loss, p1.records,
                                p1.last_line, p1.import_s), chunk
        assert f.lines_seen == f1.lines_seen, chunk
    assert p1.last_line == "last words"


# What the first GPU run showed (shared/gpu/RUN-2026-11-27.md): a bar, then a warning on its line
GPU_RUN = ("\r  6%|▋         | 5/80 [00:04<00:37,  2.03it/s]"
           "/usr/lib/python3/dist-packages/torch/utils/checkpoint.py:87: UserWarning: None of the inputs have "
           "requires_grad=True. Gradients will be None\n"
           "\rRunning tokenizer on dataset (num_proc=4):   0%|"
           "/usr/lib/python3/dist-packages/datasets/arrow.py:12: FutureWarning: the 'x' argument is deprecated\n"
           "\r  8%|▊         | 6/80 [00:05<00:36,  2.05it/s]").encode()


def test_a_warning_glued_to_a_bar_is_shown_alone():
    out, progress, _ = through_display(GPU_RUN)
    shown = [line for line in out.splitlines() if "[localhost r0]" in line]
    assert shown == [
        ("[localhost r0] /usr/lib/python3/dist-packages/torch/utils/checkpoint.py:87: UserWarning: None of the "
         "inputs have requires_grad=True. Gradients will be None"),
        ("[localhost r0] /usr/lib/python3/dist-packages/datasets/arrow.py:12: FutureWarning: the 'x' argument "
         "is deprecated")], out
    assert not FRAGMENT.search(out), out
    assert (progress.step, progress.total) == (6, 80)  # the bars still count the steps


def test_the_recorded_run_shows_no_bar_fragment_and_keeps_the_line_glued_to_one():
    data = (DATA / "cpu-3steps.node-0.log").read_bytes()
    assert b"it/s][INFO|trainer.py" in data  # (recorded: a log line written right after a bar)
    lines = []
    splitter = LineSplitter(lines.append, lambda bar: None)
    splitter.feed(data)
    splitter.close()
    glued = [line for line in lines if "Saving model checkpoint to" in line]
    assert glued and all(line.startswith("[INFO|trainer.py:") for line in glued), glued
    # a line with a piece of a bar in it is a whole bar's last state (what a terminal ends on)
    barred = [line for line in lines if FRAGMENT.search(line)]
    assert barred and all(split_bars("\r" + line)[0] == [] for line in barred), barred
    out, _, _ = through_display(data)
    assert not FRAGMENT.search(out), out


def test_split_bars_forms():
    assert split_bars("\r 10%|#  |\r 50%|## |\r100%|###|") == ([], "100%|###|", False)
    assert split_bars("\r  0%|          | 0/3 [00:00<?, ?it/s][INFO|x.py:1] >> saving") == (
        ["[INFO|x.py:1] >> saving"], "  0%|          | 0/3 [00:00<?, ?it/s]", True)
    assert split_bars("\rConverting format of dataset: 368 examples [00:00, 16670.67 examples/s]   ") == (
        [], "Converting format of dataset: 368 examples [00:00, 16670.67 examples/s]   ", False)
    assert split_bars("\r     \r{'train_runtime': '0.1', 'epoch': '0.06'}") == (
        [], "{'train_runtime': '0.1', 'epoch': '0.06'}", False)
    assert split_bars("overwritten\rwarning: x") == ([], "warning: x", False)


def test_startup_parts_split_off_the_entrys_own_import_time():
    stages = [("starting LlamaFactory", 25.0), ("waiting for ranks", 25.5), ("loading tokenizer (2 ranks connected)", 26.0),
              ("loading dataset", 26.5), ("tokenizing dataset", 27.5), ("loading dataset", 28.0),
              ("loading model", 28.5), ("preparing the model (LoRA)", 30.5), ("starting the first step", 31.0)]
    parts = startup_parts(0.0, stages, 32.0, import_s=21.8)
    assert parts == [(LAUNCH_PART, 25.0 - 21.8), (IMPORT_PART, 21.8), ("starting LlamaFactory", 0.5),
                     ("waiting for ranks", 0.5), ("loading tokenizer", 0.5), ("loading dataset", 1.5),
                     ("tokenizing dataset", 0.5), ("loading model", 2.0), ("preparing the model", 0.5),
                     ("starting the first step", 1.0)]
    assert sum(s for _, s in parts) == 32.0
    assert startup_text(parts).startswith(f"32.0 s: {LAUNCH_PART} 3.2 s, {IMPORT_PART} 21.8 s, ")
    assert startup_parts(0.0, [], 5.0) == []


def test_the_entrys_import_line_and_the_stages_reach_the_summary():
    p = Progress(from_jsonl=True)
    for line in ("ftbundle: imported torch, transformers and LlamaFactory in 21.8 s",
                 "[INFO|2026-11-27 07:39:43] llamafactory.hparams.parser:523 >> Process rank: 0, world size: 2",
                 "[INFO|2026-11-27 07:39:44] llamafactory.model.loader >> loading weights file x"):
        p.feed_line(line)
    assert p.import_s == 21.8 and [s for s, _ in p.stages] == [
        "starting LlamaFactory", "loading tokenizer (2 ranks connected)", "loading model"]
    p.feed_record({"current_steps": 1, "total_steps": 3, "loss": 2.0})
    lines = closing_summary(run_id="r", run_dir="/d", duration_s=40, progress=p, output_dir=None, adapter=None,
                            nnodes=1)
    [startup] = [line for line in lines if line.startswith("  before step ")]
    assert f"{IMPORT_PART} 21.8 s" in startup and "loading model " in startup and "loading tokenizer " in startup


def test_the_first_stage_line_says_the_start_and_its_imports():
    out = io.StringIO()
    ui = Phases(out, tty=False, nnodes=1)
    p = Progress(from_jsonl=True)
    ui.launching(1, 1)
    ui.training(p, 1)
    p.feed_line("ftbundle: imported torch, transformers and LlamaFactory in 21.8 s")
    ui.training(p, 1)
    [line] = [x for x in out.getvalue().splitlines() if "starting LlamaFactory" in x]
    assert line.startswith("ftbundle: training: starting LlamaFactory  (") and line.endswith(
        " s since launch, imports 21.8 s of it)"), line
