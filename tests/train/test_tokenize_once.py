"""Tokenize once (issue 46 item 3), with the real LlamaFactory: the quickstart's first run
tokenizes and keeps its tokenized dataset on shared storage; the next run of the same data
(another output_dir and learning rate) loads it instead of tokenizing; a change of cutoff_len
tokenizes anew. The first run's tokens (issue 47 item 1) agree with a count of the tokenized
dataset it kept."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.support.helpers import REPO
from tests.train.test_quickstart import quickstart_copy, tiny_model  # noqa: F401 - the session's tiny model

pytestmark = pytest.mark.train


def run(job, with_dir: bool = False):
    """(ftbundle's output, rank 0's log[, the run directory]) of one run of ``job``."""
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    runs = sorted((job.parent / ".shared/runs").iterdir(), key=lambda p: p.stat().st_mtime)
    said = (proc.stdout, (runs[-1] / "node-0-localhost.a1.log").read_text())
    return (*said, runs[-1]) if with_dir else said


def edit(job, **train) -> None:
    path = job.parent / "train.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **train}))


def test_the_second_run_of_the_same_data_loads_the_tokenized_dataset_the_first_kept(tmp_path, tiny_model):  # noqa: F811
    # 46 steps of 4 samples on 2 ranks: the quickstart's 184 samples twice, each one whole
    job = quickstart_copy(tmp_path, tiny_model, max_steps=46, save_strategy="no")
    kept = job.parent / ".shared/cache/tokenized"

    out, log, run_dir = run(job, with_dir=True)
    assert f"tokenized dataset: made once by this run, kept at {kept}" in out, out
    assert "Running tokenizer on dataset" in log and "Tokenized dataset is saved at" in log
    [part] = kept.iterdir()
    assert ".part-" in part.name and (part / "dataset_dict.json").is_file()

    # tokens: the trainer's count (padding not counted) is two epochs of the tokenized dataset's
    from datasets import load_from_disk

    lengths = [len(ids) for ids in load_from_disk(str(part))["train"]["input_ids"]]
    assert len(lengths) == 184
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens"] == 2 * sum(lengths) and summary["tokens_padding"] is False, summary
    runtime = json.loads((job.parent / ".shared/output/quickstart-lora/train_results.json").read_text())
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / runtime["train_runtime"], rel=0.25)
    assert summary["tokens_per_s_per_rank"] == pytest.approx(summary["tokens_per_s"] / 2, abs=0.1)
    assert summary["mfu"] is None and summary["mfu_basis"] is None  # (a CPU run: no MFU)
    # (the summary line and summary.json say one figure: summary.json keeps it to 0.1, so at x.5 the
    # whole numbers may round apart by one; CI saw 6,813 on the line for 6,813.5 in summary.json)
    [line] = [x for x in out.splitlines() if x.startswith("  tokens       ")]
    shown = float(re.match(r"  tokens       ([\d,]+) tokens/s \(", line).group(1).replace(",", ""))
    assert abs(shown - summary["tokens_per_s"]) <= 1 and line.endswith("per rank, padding not counted)"), line

    edit(job, output_dir=".shared/output/second", learning_rate=3.0e-4)  # (not the data: the same key)
    out, log = run(job)
    key = part.name.split(".part-")[0]
    assert f"tokenized dataset: reused from {kept / key}" in out, out
    assert f"Loaded tokenized dataset from {kept / key}" in log and "Running tokenizer on dataset" not in log
    assert "tokenizing dataset: reused" in out, out  # (the start-up's parts)
    assert [p.name for p in kept.iterdir()] == [key]  # promoted: one name, the half-saved never used

    edit(job, output_dir=".shared/output/third", cutoff_len=64)  # the data changes: tokenized anew
    out, log = run(job)
    assert "tokenized dataset: made once by this run" in out and "Running tokenizer on dataset" in log
    assert len(list(kept.iterdir())) == 2
