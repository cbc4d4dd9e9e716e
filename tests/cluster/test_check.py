"""`ftbundle check` (and `--net`) against real hosts: containerized sshd hosts, each fault
made for real on one host (another torch installed, the shared mount missing, other
dataset bytes, the master port taken, the host gone), and the report must name that host.
"""

from __future__ import annotations

import io
import json
import re
import sys
import time

import pytest

from ftbundle.check import SENTINEL_WAIT_S, print_report, run_checks
from ftbundle.commands.common import load_layout, open_cluster
from tests.support.helpers import base_job, ftbundle, write_job

DATA_INFO = json.dumps({"support": {"file_name": "support.json"}})
DATA = json.dumps([{"instruction": "reset my password", "input": "", "output": "Use the link."}])


def lf_train(**extra) -> dict:
    """A LlamaFactory config (only its dataset keys matter to the check; nothing trains)."""
    return {"llamafactory": {"model_name_or_path": "org/model", "dataset": "support", "dataset_dir": "data", "output_dir": "out",
                             "save_total_limit": 1, **extra}}


def check(cluster, tmp_path, train: dict | None = None, **extra):
    """(report, printed text) of run_checks for a job on the cluster's hosts."""
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job_path = write_job(tmp_path / "job.yaml", base_job(
        "chk", cluster.shared_dir, inventory, train or {"command": "true"}, **extra))
    _, layout = load_layout(str(job_path), None)
    out = io.StringIO()
    with open_cluster(layout.hosts) as cluster:
        report, facts = run_checks(layout, cluster)
    print_report(report, out)
    report.facts = facts
    return report, out.getvalue()


def leftovers(cluster) -> dict[str, list[str]]:
    """Sentinel directories in the shared dir and check processes on any host."""
    left = {}
    for host in cluster.hosts:
        if not cluster.is_running(host):
            continue
        found = cluster.exec(host, f"ls -d {cluster.shared_dir}/.ftb-check-* /srv/*/.ftb-check-* 2>/dev/null",
                             check=False).stdout.split()
        found += cluster.pgrep(host, "python|iperf3|timeout")
        if found:
            left[host.name] = found
    return left


@pytest.fixture
def cluster3(make_cluster):
    return make_cluster(3)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_sane_cluster_passes_and_lists_every_host(cluster3, tmp_path):
    (cluster3.shared_dir / "data").mkdir()
    (cluster3.shared_dir / "data" / "dataset_info.json").write_text(DATA_INFO)
    (cluster3.shared_dir / "data" / "support.json").write_text(DATA)

    report, text = check(cluster3, tmp_path, lf_train())
    assert report.ok, text
    assert report.failures == []
    assert {f.host: len(f.gpus) for f in report.facts.hosts} == {"node0": 0, "node1": 0, "node2": 0}
    assert report.facts.bf16 is None and report.facts.storage_shared("output_dir") is True
    lines = text.splitlines()
    import torch
    import transformers
    versions = next(line for line in lines if line.startswith("versions"))
    assert f"torch={torch.__version__}" in versions and f"transformers={transformers.__version__}" in versions
    assert versions.endswith(": node[0-2]")
    assert "ssh         reachable: node[0-2]" in lines
    # the datasets are on shared storage (the workdir): read by rank 0 alone
    assert any("support.json sha256" in line and line.endswith(": node0") for line in lines), text
    assert any("the datasets are on shared storage: read once, by node0" in line for line in lines), text
    assert "            sees node[0-2]: node[0-2]" in lines
    assert "            free on node0 (rank 0), reachable from: node[1-2]" in lines
    assert "            eth0: node[1-2]" in lines  # the interface that routes to rank 0
    assert any(line.startswith(f"output_dir {cluster3.shared_dir}/out") for line in lines), text
    assert lines[-1].startswith("all 11 checks passed")
    assert report.seconds < 10, text
    assert leftovers(cluster3) == {}
    print(f"check on 3 hosts: {report.seconds:.1f}s")


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_another_torch_on_one_host_fails_naming_it(cluster3, tmp_path):
    # the job's interpreter is a wrapper; on node2 another torch distribution shadows the venv's
    wrapper = f'#!/bin/sh\nexec {sys.executable} "$@"\n'
    for host in cluster3.hosts:
        cluster3.exec(host, "mkdir -p /opt/ftbpy/bin && cat > /opt/ftbpy/bin/python && chmod +x /opt/ftbpy/bin/python",
                      input=wrapper)
    cluster3.exec("node2", "mkdir -p /opt/ftbpy/site/torch-2.13.0+cpu.dist-info /opt/ftbpy/site/torch && "
                           "printf 'Metadata-Version: 2.1\\nName: torch\\nVersion: 2.13.0+cpu\\n' "
                           "> /opt/ftbpy/site/torch-2.13.0+cpu.dist-info/METADATA && "
                           "touch /opt/ftbpy/site/torch/__init__.py && "
                           "echo \"__version__ = '2.13.0+cpu'\" > /opt/ftbpy/site/torch/version.py")
    cluster3.exec("node2", "cat > /opt/ftbpy/bin/python",
                  input=f'#!/bin/sh\nPYTHONPATH=/opt/ftbpy/site exec {sys.executable} "$@"\n')

    report, text = check(cluster3, tmp_path, runtime={"kind": "host", "python": "/opt/ftbpy/bin/python"})
    assert not report.ok
    assert "FAIL versions differ:" in text
    [failure] = [f for f in report.failures if f.startswith("versions differ")]
    assert "torch=2.13.0+cpu" in failure, failure
    assert failure.split("torch=2.13.0")[1].split(";")[0].endswith("on node2"), failure
    odd = next(line for line in text.splitlines() if "torch=2.13.0+cpu" in line)
    assert odd.endswith(": node2")
    assert leftovers(cluster3) == {}


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_shared_dir_not_shared_on_one_host_fails_naming_it(cluster3, tmp_path):
    # /srv/shared is the shared mount on node0 and node1; on node2 the mount is missing and
    # the path is a plain local directory
    for host in ("node0", "node1"):
        cluster3.exec(host, f"mkdir -p /srv && ln -s {cluster3.shared_dir} /srv/shared")
    cluster3.exec("node2", "mkdir -p /srv/shared")

    report, text = check(cluster3, tmp_path, shared_dir="/srv/shared")
    assert not report.ok
    assert "FAIL shared_dir /srv/shared is not shared by all hosts:" in text
    assert "  sees node[0-1]: node[0-1]" in text and "  sees node2: node2" in text
    assert any("node2 does not see the sentinel of node[0-1]" in f for f in report.failures), report.failures
    assert any("node[0-1] does not see the sentinel of node2" in f for f in report.failures), report.failures
    assert leftovers(cluster3) == {}
    assert cluster3.exec("node2", "ls -A /srv/shared").stdout == ""


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_dataset_different_or_missing_on_one_host_fails_naming_it(cluster3, tmp_path):
    # a workdir on each host's local disk: each host has its own copy of the data
    for host in cluster3.hosts:
        cluster3.exec(host, f"mkdir -p /srv/work/data && printf '%s' '{DATA_INFO}' > /srv/work/data/dataset_info.json"
                            " && cat > /srv/work/data/support.json", input=DATA)
    cluster3.exec("node1", "rm /srv/work/data/support.json")
    cluster3.exec("node2", "cat > /srv/work/data/support.json", input=DATA.replace("link", "LINK"))

    report, text = check(cluster3, tmp_path, lf_train(), workdir="/srv/work")
    assert not report.ok
    assert "FAIL dataset files differ or are missing:" in text
    assert ("datasets: node1: /srv/work/data/support.json missing (needed for dataset 'support')"
            in report.failures), report.failures
    [differs] = [f for f in report.failures if "differs" in f]
    assert differs.startswith("datasets: dataset 'support' file /srv/work/data/support.json differs:")
    assert differs.endswith(" on node2") and "node0;" in differs, differs

    cluster3.exec("node1", "rm /srv/work/data/dataset_info.json")
    report, _ = check(cluster3, tmp_path, lf_train(), workdir="/srv/work")
    assert "datasets: node1: /srv/work/data/dataset_info.json missing (needed for the datasets)" in report.failures


MODEL_FILES = ("mkdir -p {d}/.cache/huggingface && echo '{{}}' > {d}/config.json && "
               "head -c 3145728 /dev/zero > {d}/model.safetensors && date +%N > {d}/.cache/huggingface/meta")


def same_bytes(report):
    [c] = [c for c in report.checks if c.name == "same bytes"]
    return c


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_model_copies_that_differ_by_one_byte_are_refused_naming_the_odd_host_and_file(cluster3, tmp_path):
    """Seed trap "Nodes Out of Sync": each host's own copy of the model, node2's one byte
    off. The check names node2 and the file; each copy is read once while unchanged."""
    for host in cluster3.hosts:  # (each host's downloader metadata differs: not the model's bytes)
        cluster3.exec(host, MODEL_FILES.format(d="/srv/models/tiny"))
    flip = "printf '\\x01' | dd of=/srv/models/tiny/model.safetensors bs=1 seek=1000 conv=notrunc status=none"
    cluster3.exec("node2", flip)
    time.sleep(1.2)  # (a file changed in the last second is hashed, not remembered: coarse timestamps)
    train = lf_train(model_name_or_path="/srv/models/tiny")

    report, text = check(cluster3, tmp_path, train, workdir="/srv/work")
    c = same_bytes(report)
    assert c.failure == "the job's files differ between hosts" and "FAIL the job's files differ between hosts" in text
    [line] = c.details
    # (the digests counted by hand: sha256 over "NAME\0SHA256(FILE)\n" of config.json and model.safetensors)
    assert line == ("model_name_or_path /srv/models/tiny differs between hosts: sha256 2f86742e7c0fc56e on node[0-1]; "
                    "sha256 baf71fac0fee162d on node2; the odd host(s): node2 (files not as on node0: node2: "
                    "model.safetensors)"), line
    assert c.notes == ["model_name_or_path: 9.4 MB read and hashed on 3 host(s); an unchanged copy is not read again"]

    cluster3.exec("node2", flip.replace("x01", "x00"))  # node2's copy mended
    time.sleep(1.2)
    report, _ = check(cluster3, tmp_path, train, workdir="/srv/work")
    c = same_bytes(report)  # only node2's changed file was read again
    assert c.ok and c.notes == ["model_name_or_path: 3.1 MB read and hashed on 1 host(s); an unchanged copy is "
                                "not read again"], c.notes
    assert len(c.groups) == 1 and c.groups[0][1] == ["node0", "node1", "node2"]
    report, _ = check(cluster3, tmp_path, train, workdir="/srv/work")
    assert same_bytes(report).ok and same_bytes(report).notes == []  # nothing read at all

    # on shared storage: the same bytes for everyone by construction, read by rank 0 alone
    cluster3.exec("node0", MODEL_FILES.format(d=f"{cluster3.shared_dir}/models/tiny"))
    report, _ = check(cluster3, tmp_path, lf_train(model_name_or_path=f"{cluster3.shared_dir}/models/tiny"),
                      workdir="/srv/work")
    assert [f.host for f in report.facts.hosts if f.fingerprints] == ["node0"]
    assert same_bytes(report).ok and (f"model_name_or_path {cluster3.shared_dir}/models/tiny is on shared storage: "
                                      "read once, by node0") in same_bytes(report).notes


HUGE_MODEL = ("mkdir -p /srv/models/huge && cd /srv/models/huge && python3 -c '"
              "import json, struct; h = json.dumps({\"w\": {\"dtype\": \"BF16\", \"shape\": [10000000, 1000000], "
              "\"data_offsets\": [0, 0]}}).encode(); open(\"model.safetensors\", \"wb\").write(struct.pack(\"<Q\", len(h)) + h)'"
              " && echo '{\"hidden_size\": 1000000, \"intermediate_size\": 2000000, \"num_hidden_layers\": 10, "
              "\"num_attention_heads\": 8}' > config.json && echo '{}' > tokenizer.json")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_checkpoint_that_cannot_fit_where_output_dir_lives_is_refused_before_anything_starts(cluster3, tmp_path):
    """A model whose safetensors header says 10 T parameters (the header alone is on disk):
    full fine-tuning's checkpoint of it fits no host's disk, and the check says so, with the
    estimate and its basis, reading the real free space on each host; a LoRA of it fits."""
    for host in cluster3.hosts:
        cluster3.exec(host, HUGE_MODEL)
    train = lf_train(model_name_or_path="/srv/models/huge", finetuning_type="full", output_dir="/srv/out")
    report, text = check(cluster3, tmp_path, train, workdir="/srv/work")
    [c] = [c for c in report.checks if c.name == "checkpoint space"]
    assert c.failure == "a checkpoint cannot fit where output_dir lives", text
    free = {h.name: int(cluster3.exec(h, "df -B1 --output=avail /srv | tail -1").stdout) for h in cluster3.hosts}
    lines = c.details[:-1]  # (then the advice)
    assert lines and all(re.fullmatch(r"node[0-9\[\]\-,]+: [0-9.]+ GB free where output_dir /srv/out lives, one "
                                      r"checkpoint needs about 126\.0 TB", line) for line in lines), c.details
    assert c.notes == ["a checkpoint is about 126.0 TB: full fine-tuning: 10000.00B parameters x 4 B (fp32 "
                       "weights) + 100% of them trainable x 8 B (AdamW's 2 states), + the tokenizer's 3 B"]
    said = {f.host: f.storage["output_dir"].free for f in report.facts.hosts}
    assert all(abs(said[h] - free[h]) < 256 << 20 for h in free), (said, free)  # statvfs as df reads it

    report, text = check(cluster3, tmp_path, lf_train(model_name_or_path="/srv/models/huge", output_dir="/srv/out",
                                                      lora_rank=1, lora_target="q_proj"), workdir="/srv/work")
    [c] = [c for c in report.checks if c.name == "checkpoint space"]
    assert c.ok and c.notes[0].startswith("a checkpoint is about 252.0 MB: LoRA r=1 on 1 module(s) x 10 layers"), c.notes


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_master_port_in_use_on_rank0_fails(cluster3, tmp_path):
    pid = cluster3.exec("node0", "setsid timeout 60 python3 -c 'import socket, time; s = socket.socket(); "
                                 "s.bind((\"\", 29500)); s.listen(); time.sleep(60)' >/dev/null 2>&1 </dev/null & "
                                 "echo $!").stdout.strip()
    try:
        deadline = time.monotonic() + 10
        while ":29500" not in cluster3.exec("node0", "ss -Htln").stdout and time.monotonic() < deadline:
            time.sleep(0.1)
        report, text = check(cluster3, tmp_path)
    finally:
        cluster3.exec("node0", f"kill {pid}", check=False)
    assert not report.ok
    assert "FAIL master port 29500 in use on node0 (rank 0):" in text
    [failure] = [f for f in report.failures if "29500" in f]
    assert "already in use on node0" in failure and "python3" in failure, failure  # who holds it


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("odd", ["node0", "node2"])
def test_a_host_whose_probe_cannot_run_is_named_and_not_waited_for(cluster3, tmp_path, odd):
    """An inventory whose interpreter for one host is wrong (a lived-in fleet: a venv path that
    exists on the other hosts): its probe ends at once. The others, told through the launcher,
    stop waiting for its sentinel, rank 0 for its knock on the master port, and, when it is
    rank 0, the others stop knocking on a port no one will open (connect_s, listen_s and
    sentinel_wait_s are 5-8 s, each)."""
    inventory = cluster3.write_inventory(tmp_path / "hosts.yml",
                                         per_host={odd: {"ansible_python_interpreter": "/opt/venv/bin/python3"}})
    job_path = write_job(tmp_path / "job.yaml", base_job("chk", cluster3.shared_dir, inventory, {"command": "true"}))
    _, layout = load_layout(str(job_path), None)
    with open_cluster(layout.hosts) as cluster:
        report, facts = run_checks(layout, cluster)
    assert not report.ok
    assert [f for f in report.failures if odd in f and "/opt/venv/bin/python3" in f], report.failures
    assert [f for f in report.failures if odd not in f] == [], report.failures  # (no word of the others)
    others = [f for f in facts.hosts if f.host != odd]
    for f in others:
        assert f.storage["shared_dir"].seen == tuple(o.rank for o in others), f.storage  # (not waited for it)
    if odd == "node0":
        assert [f.port for f in others] == [{"role": "connect", "skipped": "rank 0's probe ended: "
                                             + facts.hosts[0].error}] * 2
    else:
        assert facts.hosts[0].port == {"role": "listen", "accepted": [cluster3.hosts[1].ip]}
    assert report.seconds < SENTINEL_WAIT_S, report.seconds  # (waiting for it: always more)
    print(f"check took {report.seconds:.2f}s")
    assert leftovers(cluster3) == {}


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_master_port_closed_by_a_firewall_fails_naming_who_cannot_reach_it(cluster3, tmp_path):
    # rank 0's firewall drops the rendezvous port for node2 only (a member list missing it)
    cluster3.exec("node0", "nft -f -", input=(
        "table inet ftbtest {\n  chain input {\n    type filter hook input priority -5; policy accept;\n"
        f"    ip saddr {cluster3.hosts[2].ip} tcp dport 29500 drop\n  }}\n}}\n"))
    report, text = check(cluster3, tmp_path)
    assert not report.ok
    assert "FAIL master port 29500 on node0 not reachable:" in text
    assert "  free on node0 (rank 0), reachable from: node1" in text
    assert ("master_port: node2 cannot connect to node0 port 29500 (firewall? wrong ftb_master_addr?)"
            in report.failures), report.failures
    assert [f for f in report.failures if "29500" in f and "node1" in f] == []
    assert leftovers(cluster3) == {}


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("down", ["node2", "node0"])
def test_unreachable_host_is_named_and_the_others_still_checked(cluster3, tmp_path, down):
    cluster3.kill(down)
    started = time.monotonic()
    report, text = check(cluster3, tmp_path)
    took = time.monotonic() - started
    assert not report.ok
    rank = int(down[-1])
    assert [f for f in report.failures if f.startswith(f"ssh: {down} (node rank {rank}):")], report.failures
    up = {"node2": "node[0-1]", "node0": "node[1-2]"}[down]
    assert any(line.startswith("versions") and line.endswith(f": {up}") for line in text.splitlines()), text
    if down == "node0":  # no rank 0: no port to test, but the others' sentinels still go
        assert "master_port" not in [c.name for c in report.checks]
    assert took < 20, took
    assert leftovers(cluster3) == {}
    if down == "node2":  # a burn-in asked for is not run on the others in silence (issue 45's walk)
        job = write_job(tmp_path / "burn.yaml", base_job("burn", cluster3.shared_dir, cluster3.write_inventory(
            tmp_path / "hosts-b.yml"), {"command": "true"}, on_node_loss="exclude", restarts=1))
        proc = ftbundle("check", str(job), "--burn-in", "5", timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "--burn-in not run: the check failed first (hosts not reachable); nothing was loaded" in proc.stderr
        assert "burn-in done" not in proc.stdout and "median" not in proc.stdout


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_net_check_measures_each_host_and_flags_a_throttled_link(make_cluster, tmp_path):
    """`ftbundle check --net`: iperf3 from every host to rank 0 and a real all-reduce; node2's
    link is throttled to 200 Mbit/s with tc, and only node2 is named as slow."""
    cluster = make_cluster(3)
    cluster.exec("node2", "tc qdisc add dev eth0 root tbf rate 200mbit burst 64kb latency 50ms")
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job_path = write_job(tmp_path / "job.yaml", base_job("net", cluster.shared_dir, inventory,
                                                         {"command": "true"}, nproc_per_node=2))
    started = time.monotonic()
    proc = ftbundle("check", "--net", "--min-gbps", "1", str(job_path), timeout=240)
    took = time.monotonic() - started
    text = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr  # slow is a warning, not a failure
    assert "checks passed" in text
    gbps = {m.group(1): float(m.group(2))
            for m in re.finditer(r"^iperf3      (node\d) -> node0: ([0-9.]+) Gbit/s$", text, re.M)}
    assert sorted(gbps) == ["node1", "node2"], text
    assert gbps["node2"] < 0.25 and gbps["node1"] > 1, gbps  # what tc allows, and an open veth
    warnings = [line for line in text.splitlines() if line.startswith("warning: ")]
    assert any(w.startswith("warning: node2 -> node0: ") and "under 1 Gbit/s" in w for w in warnings), text
    assert not any("node1 -> node0" in w for w in warnings), text
    bench = re.search(r"^all-reduce  gloo world 6, 16 MiB x 10: ([0-9.]+) ms each, bus bandwidth ([0-9.]+) Gbit/s",
                      text, re.M)
    assert bench and float(bench.group(2)) > 0, text
    # nothing left: no bench run directory, no iperf3 or torchrun anywhere
    assert not (cluster.shared_dir / "runs").exists()
    assert leftovers(cluster) == {}
    print(f"net check on 3 hosts x 2 ranks: {took:.1f}s; node1 {gbps['node1']:.2f} Gbit/s, "
          f"node2 (throttled) {gbps['node2']:.2f} Gbit/s, busbw {bench.group(2)} Gbit/s")
