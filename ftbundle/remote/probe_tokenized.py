"""The tokenized dataset kept on shared storage: its key and whether it is there (rank 0's probe).

A part of the probe (shipped before ftbundle/remote/probe.py: ``probe_source``), standard
library only. The launcher (ftbundle/tokenized.py) sends what changes the tokenized dataset
that it can see (the LlamaFactory config without the keys that do not touch the data, the
model's name); this part adds what only a host can read: the dataset files' digests (the
datasets fact, just computed) and the tokenizer files' (each remembered while unchanged:
probe_files.py). Their hash is the key: ``<dir>/<key>`` is LlamaFactory's ``tokenized_path``.

A run that finds no complete ``<dir>/<key>`` tokenizes and saves into ``<dir>/<key>.part-RUN``
(a fresh name: LlamaFactory would load whatever non-empty directory it is given); a later
check renames a complete one to ``<dir>/<key>`` (one rename on one file system: a half-saved
one is never used). Complete: datasets' own layout, ``dataset_dict.json`` naming the splits,
each with the ``state.json`` and ``dataset_info.json`` that save_to_disk writes last.
"""

import os

if __package__:  # imported (tests); shipped, the texts of these come before this one
    from .probe_common import json
    from .probe_files import TOKENIZER_NAMES, fingerprint, listing


def tokenized_complete(path):
    try:
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f)["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(splits) and all(os.path.isfile(os.path.join(path, str(s), name))
                                for s in splits for name in ("state.json", "dataset_info.json"))


def tokenizer_files(model_dir):
    """The model directory's files that make the tokenizer (and config.json, which a template
    or processor may read): what a tokenized dataset depends on besides the data."""
    return [(rel, full) for rel, full in listing(model_dir)
            if os.path.basename(rel) == "config.json" or os.path.basename(rel).startswith(TOKENIZER_NAMES)
            or rel.endswith((".model", ".tiktoken"))]


def tokenized(spec, out):
    """``out["tokenized"]``: {"key", "path", "ready"} or {"error"}; after the datasets fact."""
    want = spec.get("tokenized")
    if not want:
        return
    import hashlib  # (rank 0 alone, with a LlamaFactory job: not every probe's import)
    entries = out.get("datasets") or []
    if not entries or any("sha256" not in e for e in entries):
        out["tokenized"] = {"error": "not every dataset is a local file the check hashed"}
        return
    h = hashlib.sha256(json.dumps(want["basis"], sort_keys=True).encode())
    for e in entries:
        h.update(f"{e['dataset']}\0{os.path.basename(e['file'])}\0{e['sha256']}\n".encode())
    model = want.get("model_dir")
    if model:
        files = tokenizer_files(model) if os.path.isdir(model) else []
        if not files:
            out["tokenized"] = {"error": f"no tokenizer files in {model}"}
            return
        for rel, full in files:
            h.update(f"{rel}\0{fingerprint(full)['sha256']}\n".encode())
    key = h.hexdigest()[:24]
    root = want["dir"]
    final = os.path.join(root, key)
    try:
        os.makedirs(root, exist_ok=True)
        if not tokenized_complete(final):
            for name in sorted(os.listdir(root)):
                part = os.path.join(root, name)
                if name.startswith(key + ".part-") and tokenized_complete(part):
                    if os.path.lexists(final):  # (a broken one: set aside, never loaded)
                        os.rename(final, f"{final}.broken-{os.getpid()}")
                    os.rename(part, final)
                    break
    except OSError as exc:
        out["tokenized"] = {"error": f"{root}: {exc.strerror or exc}"}
        return
    out["tokenized"] = {"key": key, "path": final, "ready": tokenized_complete(final)}
