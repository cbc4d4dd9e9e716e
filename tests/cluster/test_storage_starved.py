"""A host too busy to run its reading of shared storage is not called hung storage (issue 44 item 7).

At 256 containerized hosts on 2 cores (load ~140), a healthy fleet's storage (a local bind
mount) was named "not answering" because the reading of it (a `stat` the node program starts)
had not even been run. CPU caps do not reproduce that on demand (the kernel's scheduler runs a
new process soon, however many busy loops share its cgroup), so the reading is kept from running
as directly as it can be: on node1 the `stat` of it stops itself before it runs (SIGSTOP, state
T: a process the kernel does not run), while a run (2 nodes, a `command:` job printing a line a
second) goes on over real SSH. The launcher says "host node1 is starved: ..." from what the node
program saw of its reading, never "shared storage ... not answering", and the run is not stopped;
once the reading runs, the run goes on. The real freeze (sshfs paused), where the reading waits
inside the filesystem, is still named within seconds: tests/cluster/test_storage_hang.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ftbundle.launch.storage import STORAGE_SLOW_S
from tests.support.helpers import REPO, base_job, read_stdout_until, sigint_ready, write_job

pytestmark = pytest.mark.cluster

STARVE = "/tmp/ftb-test-starve"  # on node1: while it exists, the storage reading stops before it runs
# (first on PATH: /usr/local/bin comes before /usr/bin in the login's PATH)
STOPPED_STAT = f"""#!/bin/bash
for a; do case $a in */.ftb-probe-*) [ -e {STARVE} ] && kill -STOP $$ ;; esac; done
exec /usr/bin/stat "$@"
"""


def test_a_host_that_does_not_run_its_reading_is_starved_not_hung(make_cluster, tmp_path):
    cluster = make_cluster(2)
    starved = cluster.hosts[1]
    cluster.exec(starved, "cat > /usr/local/bin/stat && chmod 755 /usr/local/bin/stat", input=STOPPED_STAT)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job(
        "starved", cluster.shared_dir, inventory,
        {"command": "i=0; while :; do echo tick $i; i=$((i + 1)); sleep 1; done"}, stall_timeout=30))
    proc = subprocess.Popen(sigint_ready([sys.executable, "-m", "ftbundle", "run", "-v", str(job)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        read_stdout_until(proc, "tick 2", timeout=120)
        cluster.exec(starved, f"touch {STARVE}")
        began = time.monotonic()
        while not any("is starved" in line for line in said) and time.monotonic() - began < 30:
            time.sleep(0.2)
        time.sleep(STORAGE_SLOW_S + 5)  # a while longer: still not named hung
        stopped = cluster.exec(starved, "for p in $(pgrep -x stat); do read -r s < /proc/$p/stat; "
                                        "echo \"${s##*) }\" | cut -c1; done", check=False).stdout.split()
        cluster.exec(starved, f"rm -f {STARVE}; for p in $(pgrep -x stat); do kill -CONT $p; done")
        read_stdout_until(proc, f"tick {int(time.monotonic() - began) + 6}", timeout=60)  # it went on
        running = proc.poll() is None
    finally:
        cluster.exec(starved, f"rm -f {STARVE}; for p in $(pgrep -x stat); do kill -CONT $p; done", check=False)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(10)
    err = "".join(said)
    assert stopped == ["T"], (stopped, err)  # (the one reading, stopped: the node asks no second one meanwhile)
    assert running, err
    assert "not answering" not in err, err
    starved_lines = [line for line in said if "is starved" in line]
    assert len(starved_lines) == 1 and starved_lines[0].startswith(
        f"ftbundle: host {starved.name} is starved: its reading of shared storage {cluster.shared_dir} has waited "), err
    assert "its process stopped (T)" in starved_lines[0], err
    print(err)
