"""`ftbundle logs -f` ends with the job and loses none of its end: node.sh's follow mode, run here
as the launcher runs it on a host. The storage that stops answering under a follow:
tests/unit/test_storage_unit.py; the real one, in containers: tests/cluster/test_storage_hang.py."""

from __future__ import annotations

import subprocess
import time

from ftbundle.launch.node import node_argv

# GNU tail follows a file on NFS by polling it (no inotify there) once a second (-s 1): a loaded
# host reads later. This one polls (its undocumented ---disable-inotify) every 2.5 s: the follow
# must not take "the job is gone" for "tail has read the log's end".
LATE_TAIL = '#!/bin/bash\nexec /usr/bin/tail ---disable-inotify -s 2.5 "$@"\n'


def test_the_line_a_job_writes_as_it_ends_is_followed_to_the_terminal(tmp_path):
    """The job writes its last line and ends just after tail's read: tail has not read that line
    when the follow sees the job gone. It comes through anyway (tail is ended through its --pid,
    and reads its files once more before it exits), and the follow still ends promptly."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tail").write_text(LATE_TAIL)
    (bin_dir / "tail").chmod(0o755)
    log, go = tmp_path / "node-0.log", tmp_path / "go"
    log.write_text("first\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    marker = "ftb-test-last-line"
    for attempt in range(2):
        go.unlink(missing_ok=True)
        job = subprocess.Popen(["bash", "-c", f'while [ ! -e {go} ]; do sleep 0.02; done; echo "last words {attempt}" >> {log}'],
                               env={**env, "FTB_JOB": marker})
        follow = subprocess.Popen(node_argv("follow", marker, str(log), "1", str(tmp_path)), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = follow.stdout.readline()  # tail's first read: it sleeps 2.5 s now
        go.touch()
        job.wait(10)
        ended = time.monotonic()
        rest, err = follow.communicate(timeout=30)
        took = time.monotonic() - ended
        assert follow.returncode == 0, err
        assert first + rest == ("first\n" if attempt == 0 else "last words 0\n") + f"last words {attempt}\n", err
        assert err == ""
        assert took < 5, took  # the job's end seen (a second), tail's next poll and last read
