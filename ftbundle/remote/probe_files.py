"""What the probe keeps on its host between checks, and the fingerprints of the job's files.

A part of the probe (shipped before ftbundle/remote/probe.py as one program: ``probe_source``
in ftbundle/check/__init__.py). Standard library only.

- The cache: a private directory (/tmp/ftbundle-UID, this user's alone) holding what was
  costly to learn (the job interpreter's versions, the files' digests) with the stamps of
  what it was based on; a value is used again only while every stamp holds.
- Fingerprints: the sha256 of a file, or of a directory tree (each file's relative name and
  digest, in order; names starting with a dot left out: a downloader's own metadata, such as
  .cache/huggingface, differs from host to host while the model does not). Each file's
  digest is remembered with its stamp (device, inode, size, mtime, ctime), so an unchanged
  copy is read once however many checks follow. While files are hashed the probe says so on
  stderr, a line at most every PROGRESS_EVERY_S::

      ftb-hashing NAME DONE TOTAL       bytes hashed so far of those this check must read

  and it stops at the probe's deadline with what it has ("unfinished": the digests of the
  files it finished are kept, the next check goes on from there).
"""

import os
import sys
import time

# the probe's json (probe_common.py's, shipped before this text); the json package when imported,
# or shipped without it (the stage program: ftbundle/stage.py)
json = globals().get("json") or __import__("json")

CACHE_ROOT = "/tmp"
HASH_CHUNK = 1 << 20
HASHING = "ftb-hashing"
PROGRESS_EVERY_S = 0.5
EACH_MAX = 256  # a directory's files named one by one (the odd file named) up to this many


def cache_dir():
    """/tmp/ftbundle-UID, made by and readable only by this user; None (no cache) when it is
    anything else: another user's, open to others, a symlink."""
    import stat
    path = os.path.join(CACHE_ROOT, f"ftbundle-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def stamp(path):
    """What changes when a file or directory is written, replaced, or gains or loses an entry."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cache_file(name, key):
    import zlib
    where = cache_dir()
    text = json.dumps(key, sort_keys=True)
    return where and os.path.join(where, f"{name}-{zlib.crc32(text.encode()):08x}.json"), text


def cache_read(name, key):
    """The value kept under ``key`` while every path it was based on has its stamp still."""
    path, text = cache_file(name, key)
    if not path:
        return None
    try:
        with open(path) as f:
            kept = json.load(f)
        if kept["key"] != text or any(stamp(p) != s for p, s in kept["stamps"]):
            return None
        return kept["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_write(name, key, value, basis, since):
    """Keep ``value`` under ``key`` with the stamps of its ``basis``; not when any of them
    changed after ``since`` (ns, taken before the value was read, less the 1 s some
    filesystems' timestamps are coarse to): the value may predate that change."""
    path, text = cache_file(name, key)
    if not path:
        return
    stamps = [[p, stamp(p)] for p in dict.fromkeys(basis)]
    if any(s is not None and s[4] >= since - 10**9 for _, s in stamps):
        return
    _write_json(path, {"key": text, "stamps": stamps, "value": value})


def _write_json(path, value):
    try:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError:
        pass


# -- fingerprints ------------------------------------------------------------------------

def listing(path):
    """(relative name, path) of the file at ``path`` (name ""), or of every file under the
    directory, in order; names starting with a dot are left out."""
    if not os.path.isdir(path):
        return [("", path)]
    found = []
    for root, subdirs, files in os.walk(path):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                full = os.path.join(root, name)
                found.append((os.path.relpath(full, path), full))
    return found


def fingerprint(path, progress=None, deadline=None):
    """{"sha256", "files", "bytes", "hashed" (bytes read now: 0 when every digest was
    remembered), "each" ({relative name: its digest's first 16 hex digits}, a directory of
    at most EACH_MAX files)}. ``progress(done, total)``: after each chunk read. Past
    ``deadline`` (time.monotonic()) it stops between chunks and answers
    {"unfinished": [done, total], "files", "bytes"}."""
    found = file_digests(path, progress, deadline)
    if "unfinished" in found:
        return found
    files, digests = found.pop("listing"), found.pop("digests")
    if files and len(files) <= EACH_MAX and files[0][0] != "":
        found["each"] = {rel: digests[rel][:16] for rel, _ in files}
    return found


def tree_digest(files):
    """The sha256 of a file (``[("", digest)]``), or of a tree: each (relative name, digest) in order."""
    import hashlib

    if len(files) == 1 and files[0][0] == "":
        return files[0][1]
    h = hashlib.sha256()
    for rel, digest in files:
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def file_digests(path, progress=None, deadline=None):
    """:func:`fingerprint`'s reading: {"sha256", "files", "bytes", "hashed", "listing"
    ([(relative name, path)], in order), "digests" ({relative name: sha256}), "sizes"
    ({relative name: bytes})}, or {"unfinished", "files", "bytes"} past ``deadline``."""
    import hashlib

    files = listing(path)
    kept_at, key = cache_file("digests", {"path": os.path.abspath(path)})
    kept = {}
    if kept_at:
        try:
            with open(kept_at) as f:
                data = json.load(f)
            kept = data["files"] if data.get("key") == key and isinstance(data.get("files"), dict) else {}
        except (OSError, ValueError, KeyError, TypeError):
            kept = {}
    names = {full for _, full in files}
    kept = {full: v for full, v in kept.items() if full in names}  # (what is gone is forgotten)
    digests, todo, size, sizes = {}, [], 0, {}
    for rel, full in files:
        st = stamp(full)
        if st is None:
            raise OSError(2, f"{full} vanished while it was listed")
        size += st[2]
        sizes[rel] = st[2]
        entry = kept.get(full)
        if entry and entry[0] == st:
            digests[rel] = entry[1]
        else:
            todo.append((rel, full, st))
    total = sum(st[2] for _, _, st in todo)
    done = 0
    for rel, full, st in todo:
        began = time.time_ns()
        h = hashlib.sha256()
        with open(full, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
                if deadline is not None and time.monotonic() > deadline:
                    return {"unfinished": [done, total], "files": len(files), "bytes": size}
        digests[rel] = h.hexdigest()
        if stamp(full) == st and st[4] < began - 10**9:  # (not changed while read, nor just before)
            kept[full] = [st, digests[rel]]
            if kept_at:
                _write_json(kept_at, {"key": key, "files": kept})
    top = tree_digest([(rel, digests[rel]) for rel, _ in files])
    return {"sha256": top, "files": len(files), "bytes": size, "hashed": done, "listing": files,
            "digests": digests, "sizes": sizes}


def hashing_progress(name):
    """A ``progress(done, total)`` that says ``ftb-hashing NAME DONE TOTAL`` on stderr, at most
    every PROGRESS_EVERY_S (and at the end)."""
    last = [0.0]

    def progress(done, total):
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or done == total:
            last[0] = now
            sys.stderr.write(f"{HASHING} {name} {done} {total}\n")
            sys.stderr.flush()

    return progress


def fingerprints(spec, out):
    """The fingerprint of each path the spec names ({name: path}): the job's node-local model
    (ftbundle/check/rules.py asks only rank 0 for what lives on shared storage)."""
    wanted = spec.get("fingerprints") or {}
    deadline = spec.get("fingerprint_deadline")
    found = {}
    for name, path in wanted.items():
        progress = hashing_progress(name)
        if not os.path.exists(path):
            found[name] = {"path": path, "error": "missing"}
            continue
        try:
            found[name] = {"path": path, **fingerprint(path, progress, deadline)}
        except OSError as exc:
            found[name] = {"path": path, "error": f"unreadable: {exc.strerror or exc}"}
    out["fingerprints"] = found


# -- the model's size: what a checkpoint of it holds (ftbundle/check/checkpoint_rules.py) ---

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "torch_dtype", "tie_word_embeddings")
TOKENIZER_NAMES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template")
HEADER_MAX = 100 << 20  # (a safetensors header larger than this is not one)


def model_size(spec, out):
    """The model directory the spec names (``model``): its parameters counted from the
    safetensors headers (each tensor's shape: exact, without reading the weights), the
    weights' bytes, pickled weights' bytes (not counted), the tokenizer files' bytes (every
    checkpoint holds a copy), and config.json's shape keys."""
    path = spec.get("model")
    if not path or not os.path.isdir(path):
        return
    found = {"path": path, "params": 0, "weights_bytes": 0, "pickled_bytes": 0, "tokenizer_bytes": 0}
    for rel, full in listing(path):
        name = os.path.basename(rel)
        size = os.path.getsize(full)
        if name.endswith(".safetensors"):
            with open(full, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 0 < n < HEADER_MAX else {}
            for key, tensor in header.items():
                if key != "__metadata__" and isinstance(tensor, dict):
                    count = 1
                    for d in tensor.get("shape") or []:
                        count *= d
                    found["params"] += count
            found["weights_bytes"] += size
        elif name.endswith((".bin", ".pt", ".pth")) and not name.startswith("training_args"):
            found["pickled_bytes"] += size
        elif name.startswith(TOKENIZER_NAMES) or name.endswith((".model", ".tiktoken")):
            found["tokenizer_bytes"] += size
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
        found["config"] = {k: config[k] for k in CONFIG_KEYS if k in config}
    except (OSError, ValueError, AttributeError):
        pass
    out["model"] = found
