"""`stage:` (issue 46 item 1) on three containerized hosts: the model and dataset (on shared
storage), a directory on the launcher and a file on one host copied to every host's own
stage_dir down a chain, each copy verified against the source's sha256 before it takes its
name; a second stage copies nothing; a host whose copy was changed gets it again, named; a host
that cannot write its stage_dir is named and nothing is started; a staged LoRA trains from the
local copies (the ranks' config and LlamaFactory's log name them)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import yaml

from tests.support.helpers import base_job, ftbundle, only_run_dir, quickstart_lora, write_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

STAGE_DIR = "/var/cache/ftbundle"


def digests(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def held(cluster, host: str, entry: str) -> dict[str, str]:
    """What ``host`` holds in stage_dir/entry: {relative name: sha256} (its own sha256sum)."""
    out = cluster.exec(host, f"cd {STAGE_DIR}/{entry} && find . -type f ! -path '*/.*' -print0 | sort -z | "
                             "xargs -0 sha256sum").stdout
    return {name[2:]: digest for digest, name in (line.split(None, 1) for line in out.splitlines())}


def entries(err: str) -> dict[str, tuple[str, str]]:
    """{source name: (entry, what the line says after the colon)} from the `staged ...` lines."""
    found = {}
    for m in re.finditer(r"^ftbundle: staged (\S+) \([^,]+, \d+ file\(s\), (\S+)\): (.*)$", err, re.M):
        found[m.group(1)] = (m.group(2), m.group(3))
    return found


def test_stage_copies_once_down_a_chain_verifies_and_reuses(make_cluster, tmp_path):
    cluster = make_cluster(3)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    train = quickstart_lora(shared, max_steps=4, save_strategy="no")
    local = tmp_path / "extra"  # on the launcher only: the launcher is the source
    (local / "deep").mkdir(parents=True)
    (local / "deep" / "weights.bin").write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    (local / "notes.txt").write_text("made on the launcher\n")
    cluster.exec("node2", "mkdir -p /opt/only && head -c 300000 /dev/urandom > /opt/only/table.bin")
    job = write_job(tmp_path / "job.yaml", base_job("stage", shared, inventory, {"llamafactory": train},
                                                    stage=["model", "dataset", str(local), "node2:/opt/only/table.bin"]))

    before = ftbundle("check", str(job), timeout=300)  # `check` says what each host holds: nothing yet
    assert before.returncode == 0, before.stdout + before.stderr
    assert f"stage to {STAGE_DIR}\n" in before.stdout, before.stdout
    assert re.search(r"^            model \(813\.\d KB, tiny-llama-[0-9a-f]{16}\): to copy: node\[0-2\]$", before.stdout,
                     re.M), before.stdout

    first = ftbundle("stage", str(job), timeout=300)
    assert first.returncode == 0, first.stderr
    said = entries(first.stderr)
    assert sorted(said) == sorted(["dataset", "model", "node2:/opt/only/table.bin", str(local)]), first.stderr
    for name, (entry, how) in said.items():
        assert how.startswith("copied to node[0-2] in "), (name, how)
    model_entry, data_entry = said["model"][0], said["dataset"][0]
    assert re.fullmatch(r"tiny-llama-[0-9a-f]{16}", model_entry) and re.fullmatch(r"data-[0-9a-f]{16}", data_entry)
    for host in ("node0", "node1", "node2"):  # every host holds the very bytes of each source
        assert held(cluster, host, model_entry) == digests(shared / "tiny-llama"), host
        assert held(cluster, host, data_entry) == digests(shared / "data"), host
        assert held(cluster, host, said[str(local)][0]) == digests(local), host
    table = cluster.exec("node2", "sha256sum /opt/only/table.bin").stdout.split()[0]
    entry = said["node2:/opt/only/table.bin"][0]
    assert all(held(cluster, h, entry) == {"table.bin": table} for h in ("node0", "node1"))
    # no half copy left behind, and nothing but the entries
    listing = cluster.exec("node1", f"ls -A {STAGE_DIR}").stdout.split()
    assert sorted(listing) == sorted(e for e, _ in said.values()), listing

    again = ftbundle("stage", str(job), timeout=300)
    assert again.returncode == 0, again.stderr
    assert {n: how for n, (_, how) in entries(again.stderr).items()} == {n: "cached on node[0-2]" for n in said}

    # node1's copy of the model changed by one byte: named, copied again to node1 alone, the same bytes
    weights = next(name for name in held(cluster, "node1", model_entry) if name.endswith(".safetensors"))
    cluster.exec("node1", f"printf x | dd of={STAGE_DIR}/{model_entry}/{weights} bs=1 seek=100 conv=notrunc status=none")
    assert held(cluster, "node1", model_entry) != digests(shared / "tiny-llama")
    checked = ftbundle("check", str(job), timeout=300)
    assert re.search(rf"^            model \([^)]*\): to copy again \({re.escape(weights)} modified since it was "
                     r"staged\): node1$", checked.stdout, re.M), checked.stdout
    assert re.search(r"^            model \([^)]*\): cached: node\[0,2\]$", checked.stdout, re.M), checked.stdout
    third = ftbundle("stage", str(job), timeout=300)
    assert third.returncode == 0, third.stderr
    how = entries(third.stderr)["model"][1]
    assert how.startswith("copied to node1 in ") and "cached on node[0,2]" in how, how
    assert f"node1's copy had changed ({weights} modified since it was staged): copied again" in how, how
    assert held(cluster, "node1", model_entry) == digests(shared / "tiny-llama")

    # a staged LoRA: the ranks read the local copies; nothing is copied again
    run = ftbundle("run", str(job), timeout=500)
    assert run.returncode == 0, run.stderr[-4000:]
    assert all(how == "cached on node[0-2]" for _, how in entries(run.stderr).values()), run.stderr
    # the staging's time is the first part of the start-up (before the launch's)
    assert re.search(r"^  before step  [\d.]+ s: staging data [\d.]+ s, launch and start-up ", run.stderr, re.M), \
        run.stderr[-3000:]
    # the closing summary says it too, under the run's figures
    assert re.search(rf"^  staged       model \(.*{model_entry}\): cached on node\[0-2\]$", run.stderr, re.M), \
        run.stderr[-3000:]
    run_dir = only_run_dir(shared)
    config = yaml.safe_load((run_dir / "llamafactory.yaml").read_text())
    assert config["model_name_or_path"] == f"{STAGE_DIR}/{model_entry}"
    assert config["dataset_dir"] == f"{STAGE_DIR}/{data_entry}"
    log = (run_dir / "node-1-node1.a1.log").read_text()
    assert f"{STAGE_DIR}/{model_entry}" in log, log[-3000:]  # (LlamaFactory loads the model from there)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "finished", summary
    kept = {s["name"]: s for s in json.loads((run_dir / "plan.json").read_text())["staged"]}
    assert kept["model"]["local"] == f"{STAGE_DIR}/{model_entry}" and kept["model"]["cached"] == ["node0", "node1",
                                                                                                  "node2"]
    runs = ftbundle("runs", str(job), timeout=120)
    assert re.search(rf"^  staged model \([\d.]+ KB, \d+ file\(s\), {model_entry}\): cached on node\[0-2\]$",
                     runs.stdout, re.M), runs.stdout


def test_a_host_that_cannot_take_its_copy_is_named_and_nothing_starts(make_cluster, tmp_path):
    cluster = make_cluster(3)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "blob").mkdir()
    (shared / "blob" / "part.bin").write_bytes(b"\1" * 500_000)
    cluster.exec("node1", "mkdir -p /srv && touch /srv/nodir")
    job = write_job(tmp_path / "job.yaml", base_job("stagebad", shared, inventory,
                                                    {"command": "touch " + str(shared / "started")},
                                                    stage=[str(shared / "blob")], stage_dir="/srv/nodir/cache"))
    # /srv/nodir is a file on node1 only: node0 and node2 can make the directory, node1 cannot
    cluster.exec("node0", "mkdir -p /srv && rm -f /srv/nodir")
    cluster.exec("node2", "mkdir -p /srv && rm -f /srv/nodir")
    run = ftbundle("run", str(job), timeout=300)
    assert run.returncode == 2, run.stderr
    assert re.search(r"staging failed, nothing was started: node1: cannot write /srv/nodir/cache: ", run.stderr), \
        run.stderr
    assert not (shared / "started").exists() and not list(shared.glob("runs/*/plan.json"))
    # a name the job cannot mean: refused before any host is reached (exit 2, the key named)
    bad = write_job(tmp_path / "bad.yaml", base_job("stagebad", shared, inventory, {"command": "true"},
                                                    stage=["model"]))
    refused = ftbundle("stage", str(bad), timeout=60)
    assert refused.returncode == 2 and "stage[0]" in refused.stderr and "no LlamaFactory config" in refused.stderr, \
        refused.stderr
