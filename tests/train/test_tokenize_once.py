"""Tokenize once (issue 46 item 3), with the real LlamaFactory: the quickstart's first run
tokenizes and keeps its tokenized dataset on shared storage; the next run of the same data
(another output_dir and learning rate) loads it instead of tokenizing; a change of cutoff_len
tokenizes anew."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.support.helpers import REPO
from tests.train.test_quickstart import quickstart_copy, tiny_model  # noqa: F401 - the session's tiny model

pytestmark = pytest.mark.train


def run(job) -> tuple[str, str]:
    """(ftbundle's output, rank 0's log) of one run of ``job``."""
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(job)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    runs = sorted((job.parent / ".shared/runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return proc.stdout, (runs[-1] / "node-0-localhost.a1.log").read_text()


def edit(job, **train) -> None:
    path = job.parent / "train.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **train}))


def test_the_second_run_of_the_same_data_loads_the_tokenized_dataset_the_first_kept(tmp_path, tiny_model):  # noqa: F811
    job = quickstart_copy(tmp_path, tiny_model, max_steps=2, save_strategy="no")
    kept = job.parent / ".shared/cache/tokenized"

    out, log = run(job)
    assert f"tokenized dataset: made once by this run, kept at {kept}" in out, out
    assert "Running tokenizer on dataset" in log and "Tokenized dataset is saved at" in log
    [part] = kept.iterdir()
    assert ".part-" in part.name and (part / "dataset_dict.json").is_file()

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
