"""`ftbundle check` (and `--net`) on this machine alone: no SSH, nothing between hosts to test
(the containerized hosts: tests/cluster/test_check.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from ftbundle.check import print_report, run_checks
from ftbundle.check.net import run_net_check
from ftbundle.commands.common import load_layout, open_cluster
from ftbundle.plan import make_plan
from tests.support.helpers import free_port, write_job
from tests.cluster.test_check import DATA, DATA_INFO, lf_train


# ---------------------------------------------------------------------------------------
# this machine alone: no SSH, nothing between hosts to test


def local_job(tmp_path: Path, **extra) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(DATA_INFO)
    (tmp_path / "data" / "support.json").write_text(DATA)
    port = free_port()
    return write_job(tmp_path / "job.yaml", {
        "name": "local", "nproc_per_node": 2, "master_port": port, "shared_dir": ".shared",
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "runtime": {"kind": "host", "python": sys.executable}, **extra})


@pytest.mark.timeout(60)
def test_local_only_plan_checks_without_ssh(tmp_path, capsys):
    (tmp_path / ".shared").mkdir()
    _, layout = load_layout(str(local_job(tmp_path, train=lf_train())), None)
    with open_cluster(layout.hosts) as cluster:
        report, _ = run_checks(layout, cluster)
    print_report(report)
    text = capsys.readouterr().out
    assert report.ok, text
    names = [c.name for c in report.checks]
    assert names == ["system", "versions", "gpus", "dirs", "datasets", "master_port"]
    assert "free on localhost (rank 0): localhost" in text and "local only" in text
    assert report.seconds < 5
    with open_cluster(layout.hosts) as cluster:
        assert run_checks(layout, cluster)[0].ok and capsys.readouterr().out == ""


@pytest.mark.timeout(120)
def test_local_net_check_runs_the_allreduce_bench(tmp_path):
    (tmp_path / ".shared").mkdir()
    _, layout = load_layout(str(local_job(tmp_path, train={"command": "true"})), None)
    out = io.StringIO()
    with open_cluster(layout.hosts) as cluster:
        report = run_net_check(make_plan(layout), cluster, out=out, size_mib=1, iters=3)
    text = out.getvalue()
    assert report.ok, text
    assert report.throughput_gbps == {} and "one host: no link between hosts to measure" in text
    assert report.bench["world"] == 2 and report.bench["backend"] == "gloo" and report.busbw_gbps > 0
    assert list((tmp_path / ".shared").iterdir()) == []  # the bench's run directory is gone


@pytest.mark.timeout(60)
def test_auto_nproc_on_hosts_without_gpus_is_refused_before_launch(tmp_path, capsys):
    from ftbundle.cli import main

    (tmp_path / ".shared").mkdir()
    path = local_job(tmp_path, train={"command": "touch started"})
    path.write_text(path.read_text().replace("nproc_per_node: 2", "nproc_per_node: auto"))
    # run and check: the check's GPU line fails, naming the fix
    for argv in (["run", str(path)], ["check", "--net", str(path)]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert ("- nproc_per_node is auto but no host has a GPU; set the number of ranks per host"
                in captured.out + captured.err), captured
    # --dry-run asks the hosts only for their GPUs, and says what it found
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    # (hosts may differ in GPU count now, issue 36: a host that sees none is what stops auto)
    assert (f"{path}: key 'nproc_per_node': is auto, but no GPU is visible to the job on some hosts: "
            "0 GPU(s) on localhost; set ftb_nproc_per_node for them in the inventory (CPU ranks), or a number here"
            in err), err
    assert not (tmp_path / "started").exists() and list((tmp_path / ".shared").iterdir()) == []
