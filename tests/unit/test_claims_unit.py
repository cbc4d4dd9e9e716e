"""A run's claims on its hosts (ftbundle/remote/claims.py, issue 45 item 4), on this machine's
disk: all or none, held while the run lives (its processes, or its check-to-start grace), stale
once its job started here and nothing of it is left, and taken over then; a `gpus` claim meets
each `gpu-I`. The containers' case (two runs at once, exactly one proceeds): tests/cluster/test_claims.py."""

from __future__ import annotations

import json
import threading

from ftbundle.layout import claim_keys
from ftbundle.remote.claims import meets, running_runs, take


def test_all_or_none_and_the_holder_is_named(tmp_path):
    d = str(tmp_path / "claims")
    assert take(d, "run-a", ["port-29500", "gpus"], 60, now=1000.0, running=set()) == (["port-29500", "gpus"], [])
    held, taken = take(d, "run-b", ["port-29501", "gpu-3"], 60, now=1010.0, running=set())
    assert held == [] and taken == [{"key": "gpus", "run": "run-a", "age_s": 10.0}]
    assert not list((tmp_path / "claims").glob("*@run-b"))  # (none of b's was written)
    assert take(d, "run-a", ["port-29500", "gpus"], 60, now=1020.0, running=set())[0]  # a run's own: kept


def test_a_claim_holds_while_its_run_lives_and_is_taken_over_after(tmp_path):
    d = tmp_path / "claims"
    take(str(d), "run-a", ["port-29500"], 60, now=1000.0, running=set())
    # after the grace, still running (a process carries its marker): held
    assert take(str(d), "run-b", ["port-29500"], 60, now=5000.0, running={"run-a"})[1]
    # its job started here (the node program's mark) and nothing of it is left: taken over
    (d / "run-a.started").write_text("")
    assert take(str(d), "run-b", ["port-29500"], 60, now=5001.0, running=set()) == (["port-29500"], [])
    assert json.loads((d / "port-29500@run-b").read_text())["run"] == "run-b"
    assert not (d / "run-a.started").exists() and not (d / "port-29500@run-a").exists()
    # never started, past its grace (a launcher killed between its check and its start): taken over
    take(str(d), "run-c", ["gpu-0"], 60, now=6000.0, running=set())
    assert take(str(d), "run-d", ["gpus"], 60, now=6030.0, running=set())[1]  # (within the grace: held)
    assert take(str(d), "run-d", ["gpus"], 60, now=6061.0, running=set())[0] == ["gpus"]
    # processes that cannot be read (another user's) are taken to be the holder's
    assert take(str(d), "run-e", ["gpus"], 60, now=9999.0, running=None)[1]


def test_two_claimers_at_once_exactly_one_wins(tmp_path):
    d = str(tmp_path / "claims")
    results = {}
    barrier = threading.Barrier(8)

    def claim(i):
        barrier.wait()
        results[i] = take(d, f"run-{i}", ["port-29500", "gpus"], 60, running=set())

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, (held, _) in results.items() if held]
    assert len(winners) == 1, results
    assert all(taken and taken[0]["run"] == f"run-{winners[0]}" for i, (_, taken) in results.items() if i != winners[0])


def test_off_rank_0_a_run_not_started_yet_is_no_conflict(tmp_path):
    """Two runs at once: rank 0's host (the arbiter) decides; elsewhere both pass until one starts."""
    d = str(tmp_path / "claims")
    take(d, "run-a", ["gpus"], 60, now=1000.0, running=set(), arbiter=False)
    assert take(d, "run-b", ["gpus"], 60, now=1001.0, running=set(), arbiter=False)[0] == ["gpus"]
    assert take(d, "run-c", ["gpus"], 60, now=1002.0, running=set(), arbiter=True)[1]  # (the arbiter's rule)
    assert take(d, "run-d", ["gpus"], 60, now=1003.0, running={"run-a"}, arbiter=False)[1][0]["run"] == "run-a"


def test_what_meets_what():
    assert meets("gpus", "gpu-1") and meets("gpu-1", "gpus") and meets("port-1", "port-1")
    assert not meets("gpu-0", "gpu-1") and not meets("port-1", "port-2") and not meets("gpus", "port-1")


def test_running_runs_reads_the_markers_of_this_machines_processes(tmp_path):
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={"FTB_JOB": "job-20261128-101010-abcd.a2-1", "PATH": "/usr/bin:/bin"})
    try:
        import time
        deadline = time.monotonic() + 5
        while "job-20261128-101010-abcd" not in (running_runs() or set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "job-20261128-101010-abcd" in running_runs()
    finally:
        proc.kill()


def test_what_each_host_claims(tmp_path):
    from tests.support.helpers import plan_of  # noqa: F401 (the same builders the plan tests use)
    from ftbundle.inventory import Host
    from ftbundle.job import parse_job
    from ftbundle.layout import make_layout

    def layout(gpus, host_gpus=None):
        job = parse_job({"name": "c", "nproc_per_node": 1, "gpus_per_node": gpus, "shared_dir": "/shared",
                         "train": {"command": "true"}}, tmp_path / "job.yaml")
        hosts = [Host("n0", "10.0.0.1", 22, None), Host("n1", "10.0.0.2", 22, None,
                                                       vars={"ftb_gpus": host_gpus} if host_gpus else {})]
        return make_layout(job, hosts, "c-20261128-101010-abcd")

    assert claim_keys(layout(1), 0) == ["port-29500", "gpus"] and claim_keys(layout(1), 1) == ["gpus"]
    assert claim_keys(layout(0), 0) == ["port-29500"] and claim_keys(layout(0), 1) == []
    assert claim_keys(layout(2, "2,3"), 1) == ["gpu-2", "gpu-3"]
