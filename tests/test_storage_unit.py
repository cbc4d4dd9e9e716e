"""Shared storage that stops answering (issue 37 item 4), without containers: the words
(:class:`ftbundle.launch.storage.StorageWatch`), and the real node program beating on while a
`stat` under shared_dir hangs (a stand-in `stat` first on PATH that waits while a file exists,
and ignores SIGTERM as a process in D state ignores everything). The real freeze, sshfs in
containers, is tests/test_storage_hang.py."""

from __future__ import annotations

import subprocess
import time

from ftbundle.launch.node import env_payload, program
from ftbundle.launch.storage import StorageWatch


def test_a_node_that_reports_its_storage_stuck_is_named_once_with_path_and_host():
    watch = StorageWatch("/shared", ["node0", "node1"])
    said = watch.observe(1, "5", at=100.0)
    assert said.startswith("shared storage /shared on node1 not answering for 5s"), said
    assert watch.observe(1, "6", at=101.0) is None  # (said once per freeze)
    assert watch.stuck() == [1]
    assert watch.describe(110.0) == "shared storage /shared on node1 not answering for 15s"
    watch.observe(0, "5", at=108.0)
    assert watch.describe(110.0) == "shared storage /shared on node[0-1] not answering for 15s"
    assert watch.observe(1, "ok", at=120.0) == "shared storage /shared on node1 answers again (after 25s)"
    assert watch.stuck() == [0] and watch.observe(1, "ok", at=121.0) is None
    assert watch.observe(0, "garbage", at=122.0) is None


FAKE_STAT = r"""#!/bin/bash
# stat, but a name under the frozen directory waits while $FREEZE exists (deaf to SIGTERM)
trap '' TERM
for a; do
  case $a in "$FROZEN"/*) while [ -e "$FREEZE" ]; do sleep 0.05; done ;; esac
done
exec /usr/bin/stat "$@"
"""


def test_node_program_beats_on_and_says_its_storage_does_not_answer(tmp_path):
    bin_dir, shared = tmp_path / "bin", tmp_path / "shared"
    bin_dir.mkdir()
    shared.mkdir()
    (bin_dir / "stat").write_text(FAKE_STAT)
    (bin_dir / "stat").chmod(0o755)
    freeze = tmp_path / "freeze"
    freeze.touch()  # frozen from the start
    (shared / "rank.log").write_text("x" * 7)
    env = {"FTB_RUN_DIR": str(shared), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(tmp_path / "job.log"),
           "FTB_EXIT": str(tmp_path / "node.exit"), "FTB_PIDFILE": str(tmp_path / "node.pid"),
           "FTB_HBFILE": str(tmp_path / "node.hb"), "FTB_MARKER": "ftb-test-storage", "FTB_ATTEMPT": "1",
           "FTB_WATCHDOG": "10", "FTB_HEARTBEAT": "0.2", "FTB_STOP_GRACE": "1", "FTB_DETACH": "0",
           "FTB_PROGRESS_FILES": f"{shared}/*.log", "FTB_PROGRESS_EVERY": "1", "FTB_SHARED_DIR": str(shared),
           "FTB_STORAGE_SLOW": "1"}
    proc = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sh", "-c", "sleep 5; exit 3"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                                 "FROZEN": str(shared), "FREEZE": str(freeze)})
    # (the baseline before the job is read in the node program itself: not frozen yet for it)
    freeze.rename(tmp_path / "thawed")
    proc.stdin.write(env_payload(env))
    proc.stdin.flush()
    time.sleep(0.3)
    (tmp_path / "thawed").rename(freeze)
    most = 0
    for _ in range(40):  # 2 s frozen: the stand-in stats that wait, at most one at a time
        ps = subprocess.run(["pgrep", "-f", f"{bin_dir}/stat"], capture_output=True, text=True,
                            check=False).stdout.split()
        most = max(most, len(ps))
        time.sleep(0.05)
    freeze.unlink()
    time.sleep(1.5)
    freeze.touch()  # frozen again when the job ends (exit 3): the node program still ends
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=15)
    finally:
        freeze.unlink(missing_ok=True)
    ended_after = time.monotonic() - t0
    out = proc.stderr.read().decode().splitlines()
    proc.stdin.close()
    assert code == 3, out
    assert most == 1, most
    storage = [line for line in out if line.startswith("ftb-storage")]
    assert storage and storage[0] in ("ftb-storage 1", "ftb-storage 2"), out
    ok = out.index("ftb-storage ok")
    frozen = out[out.index(storage[0]):ok]
    # beats went on meanwhile, without progress readings (those wait on the storage)
    assert sum(line == "ftb-hb" for line in frozen) >= 3, out
    assert any(line == "ftb-hb 7" for line in out[ok:]), out  # readings again once it answers
    assert ended_after < 8, (ended_after, out)  # (its disk-full look at the end waits 2 s at most)


def test_check_names_storage_that_does_not_answer_and_not_as_a_missing_directory():
    from ftbundle.check.facts import parse_facts
    from ftbundle.check.rules import check_dirs, check_storage_answers

    frozen = {"storage": {"shared_dir": {"path": "/shared", "not_answering_s": 5.0}}}
    fine = {"storage": {"shared_dir": {"path": "/shared", "exists": True, "parent_exists": True, "written": True,
                                       "seen": [0, 1]}}}
    facts = [parse_facts("node0", 0, fine), parse_facts("node1", 1, frozen)]
    check = check_storage_answers(facts)
    assert not check.ok and check.messages() == [(
        "storage: shared storage /shared (shared_dir) on node1 not answering for 5s: a stat under it got no "
        "answer (a hung network filesystem: its server down, or the network to it cut?); every process that "
        "touches it waits until it answers")]
    assert check_storage_answers([facts[0]]) is None

    class Layout:
        workdir = shared_dir = "/shared"
    assert check_dirs(facts, Layout()).ok  # (not "does not exist": it did not answer)
