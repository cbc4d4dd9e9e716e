"""The same bytes on every host (issue 46 item 2): the probe's fingerprints of a node-local
model (remote/probe_files.py: each file's digest remembered while the file is unchanged, its
progress said while it hashes), and the rule that refuses a fleet whose copies differ,
naming the odd hosts and files (check/bytes_rules.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from ftbundle.check import Hashing, probe_source, probe_spec
from ftbundle.check import rules as R
from ftbundle.check.bytes_rules import files_apart
from ftbundle.remote import probe_files as P
from tests.unit.test_check_unit import facts, layout_of, local_spec


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setattr(P, "CACHE_ROOT", str(root))
    return root


def model_dir(root, files: dict[str, bytes]):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


MODEL = {"config.json": b'{"hidden_size": 8}', "model.safetensors": os.urandom(3 << 20),
         "tokenizer.json": b"{}", ".cache/huggingface/download/model.safetensors.metadata": b"etag 1\n"}


def test_a_model_directory_is_hashed_once_while_unchanged_and_again_when_a_file_changes(tmp_path, cache_root):
    m = model_dir(tmp_path / "m", MODEL)
    time.sleep(1.1)  # (a file changed less than 1 s ago is not trusted to its stamp: coarse timestamps)
    seen = []
    first = P.fingerprint(str(m), progress=lambda done, total: seen.append((done, total)))
    size = sum(len(v) for k, v in MODEL.items() if not k.startswith("."))
    assert first["files"] == 3 and first["bytes"] == size and first["hashed"] == size
    assert seen[-1] == (size, size) and len(seen) >= 3  # (1 MB chunks: the progress moves)
    assert first["each"]["model.safetensors"] == hashlib.sha256(MODEL["model.safetensors"]).hexdigest()[:16]
    expected = hashlib.sha256("".join(f"{n}\0{hashlib.sha256(MODEL[n]).hexdigest()}\n"
                                      for n in sorted(k for k in MODEL if not k.startswith("."))).encode())
    assert first["sha256"] == expected.hexdigest()

    again = P.fingerprint(str(m))  # remembered: nothing read
    assert again["hashed"] == 0 and again["sha256"] == first["sha256"]
    # a downloader's metadata differs from host to host: not the model's bytes
    (m / ".cache/huggingface/download/model.safetensors.metadata").write_bytes(b"etag 2\n")
    assert P.fingerprint(str(m))["sha256"] == first["sha256"]

    # one byte changed in place, same size: read again, and another digest
    data = bytearray(MODEL["model.safetensors"])
    data[1000] ^= 1
    (m / "model.safetensors").write_bytes(bytes(data))
    changed = P.fingerprint(str(m))
    assert changed["hashed"] == len(data) and changed["sha256"] != first["sha256"]
    assert changed["each"]["config.json"] == first["each"]["config.json"]
    assert files_apart(changed["each"], first["each"]) == ["model.safetensors"]
    (m / "extra.bin").write_bytes(b"x")
    assert files_apart(P.fingerprint(str(m))["each"], first["each"]) == ["extra.bin extra", "model.safetensors"]


def test_a_single_file_is_its_own_digest_and_the_deadline_stops_hashing(tmp_path, cache_root):
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(4 << 20))
    whole = P.fingerprint(str(f))
    assert whole["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() and "each" not in whole
    late = P.fingerprint(str(f), deadline=time.monotonic() - 1)  # past it: stops after a chunk
    assert late == {"unfinished": [1 << 20, 4 << 20], "files": 1, "bytes": 4 << 20}


def test_the_probe_fingerprints_what_the_spec_names_and_says_its_progress_on_stderr(tmp_path):
    m = model_dir(tmp_path / "m", {"config.json": b"{}", "w.bin": os.urandom(2 << 20)})
    spec = local_spec(tmp_path, fingerprints={"model_name_or_path": str(m),
                                              "other": str(tmp_path / "absent")})
    proc = subprocess.run([sys.executable, "-", json.dumps(spec)], input=probe_source(), capture_output=True,
                          timeout=60, check=True)
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    fp = out["fingerprints"]["model_name_or_path"]
    assert fp["path"] == str(m) and fp["files"] == 2 and len(fp["sha256"]) == 64
    assert out["fingerprints"]["other"] == {"path": str(tmp_path / "absent"), "error": "missing"}
    lines = [x for x in proc.stderr.decode().splitlines() if x.startswith(P.HASHING)]
    total = (2 << 20) + 2
    assert lines and lines[-1] == f"{P.HASHING} model_name_or_path {total} {total}", proc.stderr


def test_the_launcher_sums_the_hosts_hashing_lines_into_one(monkeypatch):
    said = []
    h = Hashing(said.append)
    h.feed("node0", b"ftb-hashing model_name_or_path 1000 1000\n")
    assert said == []  # (a hash done within a second is not said at all)
    h = Hashing(said.append)
    h.feed("node0", b"ftb-hashing model_name_or_path 1000000 4000")  # (a line arrives in pieces)
    h.started = h.last = h.started - 1.5  # (a second and a half later)
    assert said == []
    h.feed("node0", b"000\nftb-hashing model_name_or_path 2000000 4000000\n")
    assert len(said) == 1 and said[0].startswith("hashing model_name_or_path: 2.0 MB of 4.0 MB on 1 host(s), ")
    h.feed("node1", b"ftb-hashing model_name_or_path 1000000 4000000\n")
    assert len(said) == 1  # (a line a second at most, however many hosts report)
    h.feed("node1", b"ftb-hashing model_name_or_path 4000000 4000000\nTraceback: not a progress line\n")
    h.feed("node0", b"ftb-hashing model_name_or_path 4000000 4000000\n")
    assert said[-1].startswith("hashing model_name_or_path: 8.0 MB of 8.0 MB on 2 host(s), ")  # (the end is said)


def test_only_rank_0_reads_what_is_on_shared_storage(tmp_path):
    local = layout_of(tmp_path, 3, train={"llamafactory": {"model_name_or_path": "/models/m", "dataset": "d",
                                                           "dataset_dir": "/data"}})
    shared = layout_of(tmp_path, 3, train={"llamafactory": {"model_name_or_path": "/shared/models/m",
                                                            "dataset": "d", "dataset_dir": "/shared/data"}})

    def asked(layout, rank):
        spec = probe_spec(layout, rank, token="t", expect=[0, 1, 2], port_peers=None)
        return spec.get("fingerprints"), spec.get("datasets")

    assert asked(local, 2) == ({"model_name_or_path": "/models/m"}, {"dir": "/data", "names": ["d"]})
    assert asked(shared, 0) == ({"model_name_or_path": "/shared/models/m"}, {"dir": "/shared/data", "names": ["d"]})
    assert asked(shared, 2) == (None, None)
    # a read-only probe (--dry-run) hashes nothing; a hub id is not a path
    assert "fingerprints" not in probe_spec(local, 1, token=None, expect=[1], port_peers=None, create=False)
    hub = layout_of(tmp_path, 2, train={"llamafactory": {"model_name_or_path": "Qwen/Qwen2.5-0.5B"}})
    assert "fingerprints" not in probe_spec(hub, 1, token="t", expect=[0, 1], port_peers=None)


def fp(digest: str, **each) -> dict:
    return {"path": "/models/m", "sha256": digest * 64, "files": len(each), "bytes": 10, "hashed": 0,
            "each": each}


def test_copies_that_differ_are_refused_naming_the_odd_host_and_its_files():
    good = fp("a", **{"config.json": "1" * 16, "model.safetensors": "2" * 16})
    odd = fp("b", **{"config.json": "1" * 16, "model.safetensors": "3" * 16, "notes.txt": "4" * 16})
    c = R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": good}),
                             facts("node1", 1, fingerprints={"model_name_or_path": good}),
                             facts("node2", 2, fingerprints={"model_name_or_path": odd})])
    assert c.failure == "the job's files differ between hosts"
    assert c.details == [f"model_name_or_path /models/m differs between hosts: sha256 {'a' * 16} on node[0-1]; "
                         f"sha256 {'b' * 16} on node2; the odd host(s): node2 (files not as on node0: node2: "
                         "model.safetensors, notes.txt extra)"]
    # two hosts, one each: no majority, neither called odd
    c = R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": good}),
                             facts("node1", 1, fingerprints={"model_name_or_path": odd})])
    assert not c.ok and "no majority" in c.details[0] and "odd host" not in c.details[0]


def test_the_same_bytes_pass_and_a_copy_not_yet_hashed_is_a_warning_not_a_verdict():
    good = fp("a", **{"w": "1" * 16})
    c = R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": dict(good, hashed=10)}),
                             facts("node1", 1, fingerprints={"model_name_or_path": good})])
    assert c.ok and c.groups == [(f"model_name_or_path /models/m sha256 {'a' * 16}", ["node0", "node1"])]
    assert c.notes == ["model_name_or_path: 10 B read and hashed on 1 host(s); an unchanged copy is not read again"]
    slow = {"path": "/models/m", "unfinished": [5 * 10**9, 140 * 10**9], "files": 30, "bytes": 140 * 10**9}
    c = R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": good}),
                             facts("node1", 1, fingerprints={"model_name_or_path": slow})])
    assert c.ok and c.warnings == ["model_name_or_path /models/m on node1 not compared: 5.0 GB of 140.0 GB hashed "
                                   "within the check's time (the hashed files are remembered: the next check goes "
                                   "on from there)"]
    # a missing copy is the job-fits rule's to name; an unreadable one is named here
    gone = {"path": "/models/m", "error": "missing"}
    assert R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": good}),
                                facts("node1", 1, fingerprints={"model_name_or_path": gone})]).ok
    locked = {"path": "/models/m", "error": "unreadable: Permission denied"}
    c = R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": good}),
                             facts("node1", 1, fingerprints={"model_name_or_path": locked})])
    assert c.details == ["node1: model_name_or_path /models/m: unreadable: Permission denied"]
    # on shared storage rank 0 alone answered
    c = R.check_model_bytes([facts("node0", fingerprints={"model_name_or_path": good}), facts("node1", 1)])
    assert c.ok and c.notes == ["model_name_or_path /models/m is on shared storage: read once, by node0"]
    assert R.check_model_bytes([facts("node0"), facts("node1", 1)]) is None


def test_the_probes_compiled_code_is_kept_on_the_host_while_its_source_is_the_same(tmp_path):
    """Compiling the probe is ~10 ms of CPU per host per check: the loader keeps its code object
    in the private cache directory, named by the source's digest, and runs it from there."""
    import glob

    from ftbundle.check import probe_argv, probe_loader
    from ftbundle.inventory import Host

    argv = probe_argv(Host("localhost", "127.0.0.1", local=True), json.dumps(local_spec(tmp_path)))
    digest = probe_loader()[1]
    kept = f"/tmp/ftbundle-{os.getuid()}/probe-{digest}-{sys.implementation.cache_tag}.code"
    for old in glob.glob(kept):
        os.remove(old)
    first = subprocess.run(argv, input=probe_source(), capture_output=True, timeout=60, check=True)
    assert os.path.isfile(kept) and json.loads(first.stdout.decode().splitlines()[-1])["hostname"]
    again = subprocess.run(argv, input=b"", capture_output=True, timeout=60, check=True)  # (no source: the kept code)
    assert json.loads(again.stdout.decode().splitlines()[-1])["hostname"] == json.loads(first.stdout)["hostname"]
    other = [*argv[:-1], "0" * 16]  # another source (another ftbundle): compiled from stdin, not the kept one
    assert subprocess.run(other, input=b"raise SystemExit(7)", capture_output=True, timeout=60).returncode == 7
    os.remove(kept.replace(digest, "0" * 16))
