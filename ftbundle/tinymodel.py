"""Make a tiny, real, Llama-architecture model from local data.

Why this exists: the machines this project is built and tested on cannot reach a model
hub, yet the tests and the quickstart demo need a *real* model directory that
LlamaFactory / transformers load like any other (``config.json``, safetensors weights,
a fast tokenizer).  So we make one locally:

* a byte-level BPE tokenizer trained with ``tokenizers`` on the texts of the dataset(s)
  (plus the strings of LlamaFactory's ``default`` template), wrapped as a
  ``transformers.PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<pad>``/``<unk>``;
* a randomly initialised ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, vocabulary
  512: a couple of hundred thousand parameters), so LoRA SFT on the CPU takes seconds.

The result is deterministic (seeded) and the call is idempotent: a stamp file holding a
hash of the inputs and parameters is written last, and a later call with the same inputs
returns at once without touching the files.  The model is built in a sibling temporary
directory and renamed into place, so an interrupted run never leaves a half model that
looks finished.

The heavy imports (torch, transformers, tokenizers) happen inside :func:`make_tiny_model`
so that importing this module stays cheap.

CLI::

    python -m ftbundle.tinymodel --data examples/quickstart/data/support.json --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

STAMP_NAME = "ftbundle-tinymodel.json"
# Bump when the recipe changes in a way that changes the produced files.
RECIPE_VERSION = 1

SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
# Strings LlamaFactory's `default` template wraps around every example; training the
# tokenizer on them gives them compact encodings.
TEMPLATE_TEXTS = ["Human: ", "\nAssistant:", "System: ", "\n"]
# Files that must exist for a stamped directory to count as complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _iter_strings(obj) -> Iterator[str]:
    """Every string inside a JSON value (alpaca, sharegpt, plain lists: all work)."""
    if isinstance(obj, str):
        if obj:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _iter_strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _iter_strings(value)


def _texts_of(path: Path) -> list[str]:
    """The training texts of one data file (.json, .jsonl, anything else as plain text)."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return list(_iter_strings(json.loads(raw)))
    if path.suffix == ".jsonl":
        texts: list[str] = []
        for line in raw.splitlines():
            if line.strip():
                texts.extend(_iter_strings(json.loads(line)))
        return texts
    return [line for line in raw.splitlines() if line.strip()]


def _fingerprint(data_files: Iterable[Path], params: dict) -> str:
    """Hash of the recipe version, the parameters and the *contents* of the data files.

    Paths are deliberately left out, so a moved checkout keeps its cached model.
    """
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE_VERSION, **params}, sort_keys=True).encode())
    for path in data_files:
        h.update(b"\0file\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _is_current(out_dir: Path, fingerprint: str) -> bool:
    try:
        stamp = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("fingerprint") == fingerprint and all((out_dir / f).is_file() for f in REQUIRED_FILES)


def make_tiny_model(
    data_files: list[Path],
    out_dir: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    """Train a tokenizer on ``data_files`` and save a tiny random Llama model in ``out_dir``.

    Returns ``out_dir``.  A no-op when ``out_dir`` already holds a model made from the
    same data contents and parameters (see the module docstring).
    """
    data_files = [Path(p) for p in data_files]
    out_dir = Path(out_dir)
    if not data_files:
        raise ValueError("make_tiny_model needs at least one data file")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    params = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab, "seed": seed}
    fingerprint = _fingerprint(data_files, params)
    if _is_current(out_dir, fingerprint):
        return out_dir

    # Heavy imports only when there is work to do.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts: list[str] = []
    for path in data_files:
        texts.extend(_texts_of(path))
    if not texts:
        raise ValueError(f"no text found in {', '.join(map(str, data_files))}")
    texts.extend(TEMPLATE_TEXTS)

    # --- tokenizer: byte-level BPE -------------------------------------------------
    specials = [SPECIAL_TOKENS[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token")]
    bpe = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        model_max_length=1024,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS,
    )
    real_vocab = len(tokenizer)

    # --- model: tiny Llama ------------------------------------------------------------
    config = LlamaConfig(
        vocab_size=real_vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)

    # --- save atomically: build next to out_dir, then rename into place ---------------
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # transformers 5 records its new class name ("TokenizersBackend"), which 4.x
        # cannot load; the old name loads on both.
        tok_cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        stamp = {
            "fingerprint": fingerprint,
            "params": params,
            "recipe": RECIPE_VERSION,
            "data_files": [p.name for p in data_files],
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": real_vocab,
        }
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
        # mkdtemp makes the directory 0700 and some writers make 0600 files; the model
        # is shared (other users, other hosts), so give it ordinary umask permissions.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ftbundle.tinymodel",
        description="Make a tiny Llama model + BPE tokenizer from local data (no model hub needed).",
    )
    ap.add_argument("--data", type=Path, action="append", required=True,
                    help="dataset file (.json/.jsonl/text); repeat for several")
    ap.add_argument("--out", type=Path, required=True, help="output model directory")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for path in args.data:
        if not path.is_file():
            ap.error(f"no such data file: {path}")
    out = make_tiny_model(args.data, args.out, hidden=args.hidden, layers=args.layers,
                          heads=args.heads, vocab=args.vocab, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
