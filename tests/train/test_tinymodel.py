"""The tiny local model: loadable by transformers, small, round-trips text, cached by stamp."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.train

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "quickstart" / "data" / "support.json"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _snapshot(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.iterdir())}


def test_make_tiny_model(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftbundle.tinymodel import STAMP_NAME, make_tiny_model

    out = tmp_path / "tiny-llama"
    assert make_tiny_model([DATA], out) == out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", STAMP_NAME):
        assert (out / name).is_file(), name
    # Nothing left behind from the atomic build.
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
    n_params = sum(p.numel() for p in model.parameters())
    assert 50_000 <= n_params <= 2_000_000, n_params

    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert len(tok) <= model.config.vocab_size
    sample = "Human: How do I reset my Lumen Plug? Ünïcode ✓\nAssistant: Hold the button for 15 seconds."
    ids = tok.encode(sample, add_special_tokens=False)
    assert tok.decode(ids) == sample
    assert len(ids) < len(sample.encode())  # BPE merges learned from the data actually compress

    # Second call: the stamp is honoured, nothing is rewritten, and it is quick.
    before = _snapshot(out)
    time.sleep(0.01)
    t0 = time.monotonic()
    assert make_tiny_model([DATA], out) == out
    assert time.monotonic() - t0 < 1.0
    assert _snapshot(out) == before


def test_deterministic_and_params_invalidate(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from ftbundle.tinymodel import make_tiny_model

    a = make_tiny_model([DATA], tmp_path / "a")
    b = make_tiny_model([DATA], tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    # Different parameters: the stamp no longer matches, so the model is rebuilt.
    stamp_before = (a / "ftbundle-tinymodel.json").read_text()
    make_tiny_model([DATA], a, seed=1)
    assert (a / "ftbundle-tinymodel.json").read_text() != stamp_before
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
