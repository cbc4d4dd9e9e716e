"""`stage:` (issue 46 item 1) on this machine alone: the job's words, the entry names, the
ranks' config, and the node program for real (a local host: the launcher feeds it, or a
`send` on the host reads shared storage): copied, cached, a changed copy named and replaced,
a corrupt stream refused with no half copy left. Three hosts down a chain:
tests/cluster/test_stage.py."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from ftbundle.cluster import Cluster
from ftbundle.commands.common import load_layout
from ftbundle.errors import UserError
from ftbundle.inventory import Host
from ftbundle.remote.stage_node import entry_state
from ftbundle.stage import Source, StageError, entry_name, node_argv, node_stdin, sources, stage_one
from tests.unit.test_check_local_unit import local_job

LOCAL = Host("localhost", "127.0.0.1", local=True)


def tree(root, files: dict[str, bytes]):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def layout_of(tmp_path, stage, train=None, **keys):
    """A local job's layout, in a directory of its own under ``tmp_path`` (its `.shared` there)."""
    root = tmp_path / f"job{len(list(tmp_path.glob('job*')))}"
    root.mkdir()
    _, layout = load_layout(str(local_job(root, train=train or {"command": "true"}, stage=stage, **keys)), None)
    return layout


def test_the_jobs_words_are_sources_and_nonsense_is_refused_with_its_key(tmp_path):
    lf = {"llamafactory": {"model_name_or_path": ".shared/model", "stage": "sft",
                           "do_train": True, "dataset": "demo", "template": "llama3", "finetuning_type": "lora",
                           "output_dir": ".shared/out"}}
    layout = layout_of(tmp_path, ["model", "dataset"], lf)
    model, data = sources(layout)
    assert (model.path, model.key, model.shared, model.host) == (f"{layout.shared_dir}/model",
                                                                "model_name_or_path", True, None)
    assert data.key == "dataset_dir" and data.path.endswith("/data")
    with pytest.raises(UserError, match=r"'model' means the LlamaFactory config's model_name_or_path: this job runs "
                                        r"no LlamaFactory config") as err:
        sources(layout_of(tmp_path, ["model"]))
    assert err.value.key == "stage[0]"
    with pytest.raises(UserError, match=r"is neither on this machine nor under shared_dir") as err:
        sources(layout_of(tmp_path, ["dataset", "/nowhere/at/all"], lf))
    assert err.value.key == "stage[1]"
    with pytest.raises(UserError, match=r"node9 is not one of the job's hosts \(localhost\)"):
        sources(layout_of(tmp_path, ["node9:/data"]))
    with pytest.raises(UserError, match=r"is staged twice"):
        sources(layout_of(tmp_path, [str(tmp_path), str(tmp_path) + "/."]))
    hub = dict(lf["llamafactory"], model_name_or_path="Qwen/Qwen2.5-0.5B")
    with pytest.raises(UserError, match=r"'Qwen/Qwen2.5-0.5B' is not a path \(a hub id\?\)"):
        sources(layout_of(tmp_path, ["model"], {"llamafactory": hub}))


def test_the_job_refuses_a_stage_that_is_not_a_list_and_a_relative_stage_dir(tmp_path):
    with pytest.raises(UserError, match=r"must be a list of what to copy") as err:
        layout_of(tmp_path, {"model": 1})
    assert err.value.key == "stage"
    with pytest.raises(UserError, match=r"must be an absolute directory on every host's own disk") as err:
        layout_of(tmp_path, ["model"], stage_dir="cache")
    assert err.value.key == "stage_dir"


def test_entries_are_named_by_the_source_and_its_digest_and_the_ranks_read_them():
    src = Source("model", "/shared/models/Llama 3.1-8B/", None, True, "model_name_or_path")
    assert entry_name(src, "ab" * 32) == "Llama_3.1-8B-" + "ab" * 8
    from ftbundle.stage import Staged

    staged = {"model": Staged(src, local="/var/cache/ftbundle/x"),
              "/extra": Staged(Source("/extra", "/extra", None, False, None), local="/var/cache/ftbundle/y")}
    config = {"model_name_or_path": "/shared/models/Llama", "dataset_dir": "data"}
    from ftbundle.stage import staged_keys

    assert staged_keys(staged) == {"model_name_or_path": "/var/cache/ftbundle/x"}  # (a plain path replaces no key)
    # as make_plan lays them over the config the ranks read
    assert {**config, **staged_keys(staged)} == {"model_name_or_path": "/var/cache/ftbundle/x", "dataset_dir": "data"}


def test_copied_cached_changed_and_copied_again_from_the_launcher_and_from_the_host(tmp_path):
    src = tree(tmp_path / "src", {"w/a.bin": bytes(range(256)) * 4096, "config.json": b"{}", ".hidden": b"x"})
    stage_dir = tmp_path / "cache"
    said = []
    with Cluster([LOCAL]) as cluster:
        cluster.open()
        fed = Source("m", str(src), None, False, None)  # on the launcher: it feeds the host's stdin
        first = stage_one(cluster, fed, [LOCAL], str(stage_dir), say=said.append)
        entry = stage_dir / first.entry
        assert first.copied == ["localhost"] and first.cached == [] and first.files == 2
        assert first.bytes == 256 * 4096 + 2 and first.local == str(entry)
        assert (entry / "w" / "a.bin").read_bytes() == (src / "w" / "a.bin").read_bytes()
        assert not (entry / ".hidden").exists() and sorted(p.name for p in stage_dir.iterdir()) == [first.entry]
        again = stage_one(cluster, fed, [LOCAL], str(stage_dir), say=said.append)
        assert again.cached == ["localhost"] and again.copied == [] and again.entry == first.entry
        assert again.line().endswith(": cached on localhost")
        (entry / "config.json").write_bytes(b"{}\n")  # changed in the cache: named, copied again
        assert entry_state(str(entry)) == ("changed", "config.json size 3, staged 2")
        third = stage_one(cluster, fed, [LOCAL], str(stage_dir), say=said.append)
        assert third.copied == ["localhost"] and third.changed == {"localhost": "config.json size 3, staged 2"}
        assert (entry / "config.json").read_bytes() == b"{}" and entry_state(str(entry)) == ("cached", "")
        assert "localhost's copy had changed (config.json size 3, staged 2): copied again" in third.line()
        # on shared storage: a send on the host reads it (here, into itself); one file: its own name
        one = Source("t", str(src / "w" / "a.bin"), None, True, None)
        got = stage_one(cluster, one, [LOCAL], str(tmp_path / "cache2"), say=said.append)
        assert got.local == str(tmp_path / "cache2" / got.entry / "a.bin")
        whole = (src / "w" / "a.bin").read_bytes()
        assert open(got.local, "rb").read() == whole and got.entry == "a.bin-" + hashlib.sha256(whole).hexdigest()[:16]
        assert entry_state(str(tmp_path / "cache2" / got.entry)) == ("cached", "")
        # a stage_dir that cannot be made: the host and why
        (tmp_path / "file").write_text("")
        with pytest.raises(StageError, match=r"localhost: cannot write .*/file/cache: "):
            stage_one(cluster, fed, [LOCAL], str(tmp_path / "file" / "cache"), say=said.append)


def test_a_stream_whose_bytes_differ_from_the_manifest_is_refused_and_leaves_nothing(tmp_path):
    """The receiver for real, fed by hand: one byte differs from the manifest's sha256."""
    data = b"z" * 100_000
    spec = {"do": "receive", "stage_dir": str(tmp_path / "cache"), "entry": "e-1", "token": "t"}
    proc = subprocess.Popen(node_argv(LOCAL, spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(node_stdin())
    proc.stdin.flush()
    assert proc.stdout.readline().split()[:2] == [b"ftb-stage", b"port"]
    order = {"files": [["f.bin", len(data), hashlib.sha256(data).hexdigest()]], "file_name": "x", "from": "stdin",
             "next": None}
    out, _ = proc.communicate(json.dumps(order).encode() + b"\n" + data[:-1] + b"y", timeout=30)
    assert proc.returncode == 1
    assert out.decode().strip().splitlines()[-1] == "ftb-stage error sha256 differs from the source's: f.bin"
    assert list((tmp_path / "cache").iterdir()) == []  # no half copy, no entry
    # a stream that ends early: said with how far it got
    proc = subprocess.Popen(node_argv(LOCAL, spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(node_stdin())
    proc.stdin.flush()
    proc.stdout.readline()
    out, _ = proc.communicate(json.dumps(order).encode() + b"\n" + data[:5000], timeout=30)
    assert proc.returncode == 1 and b"the stream ended after 5000 of 100000 bytes (in f.bin)" in out
    assert list((tmp_path / "cache").iterdir()) == []


def test_stage_keep_prunes_the_least_recently_used_never_one_a_running_run_or_this_one_uses(tmp_path, capsys):
    import os
    import time

    from ftbundle.remote.stage_node import STAMPS, USED, mark_used, prune

    now = time.time()
    day = 86400

    def entry(name, size, used_days_ago, users):
        path = tmp_path / name
        path.mkdir()
        (path / "w.bin").write_bytes(b"\0" * size)
        (path / STAMPS).write_text(json.dumps({"w.bin": [size, 0]}))
        os.utime(path / STAMPS, (now - 90 * day, now - 90 * day))
        for user in users:
            mark_used(str(path), user)
            os.utime(path / USED / user, (now - used_days_ago * day, now - used_days_ago * day))

    entry("old-1", 1000, 40, ["r-old"])  # unused 40 days: removed at days=30
    entry("live-2", 1000, 50, ["r-live"])  # older still, but its run has a process here: kept
    entry("mine-3", 1000, 60, ["r-now"])  # this run marked it (an earlier source of it): kept
    entry("recent-4", 3000, 2, ["r-b"])
    entry("recent-5", 2000, 1, ["r-c"])
    prune(str(tmp_path), {"days": 30, "bytes": None}, "r-now", now=now, running={"r-live"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live-2", "mine-3", "recent-4", "recent-5"]
    assert capsys.readouterr().out == "ftb-stage pruned old-1 1000 40.0\n"
    # over 6000 bytes in all: the least recently used go first until it fits (recent-4, 3000 bytes)
    prune(str(tmp_path), {"days": None, "bytes": 6000}, "r-now", now=now, running={"r-live"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live-2", "mine-3", "recent-5"]
    # /proc unreadable (another user's runs unknown): nothing is removed
    prune(str(tmp_path), {"days": 0.001, "bytes": 1}, "x", now=now, running=None)
    assert len(list(tmp_path.iterdir())) == 3


def test_stage_keep_is_checked_with_its_key(tmp_path):
    with pytest.raises(UserError, match=r"must be a positive number or null") as err:
        layout_of(tmp_path, ["/tmp"], stage_keep={"days": -1})
    assert err.value.key == "stage_keep.days"
    layout = layout_of(tmp_path, ["/tmp"], stage_keep={"days": None, "size_gb": 500})
    assert layout.job.stage_keep == {"days": None, "bytes": 500_000_000_000}
    assert layout_of(tmp_path, ["/tmp"]).job.stage_keep == {"days": 30.0, "bytes": None}
