"""The node channel's words have one owner (ftbundle/protocol.py): the real node program's real
output parses into the kinds it names, and node.sh says no keyword the parser does not know.
No containers: the node program runs here, as it runs on a host."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from ftbundle import protocol
from ftbundle.launch.node import program
from ftbundle.protocol import RankSteps, parse_line, parse_progress, parse_steps, parse_storage

NODE_SH = Path(protocol.__file__).resolve().parent / "remote" / "node.sh"

FAKE_STAT = r"""#!/bin/bash
# stat, but the storage probe (a never-used name under $FROZEN) waits while $FREEZE exists
for a; do
  case $a in "$FROZEN"/.ftb-probe-*) while [ -e "$FREEZE" ]; do sleep 0.05; done ;; esac
done
exec /usr/bin/stat "$@"
"""


def test_the_real_node_programs_output_parses_into_the_protocols_kinds(tmp_path):
    """A node with a GPU, its ranks' output growing, their step times and a storage reading that
    waits and then answers: every line it says on stderr is one of the protocol's, and each
    parses into what it meant."""
    bin_dir, shared = tmp_path / "bin", tmp_path / "shared"
    bin_dir.mkdir()
    shared.mkdir()
    (bin_dir / "stat").write_text(FAKE_STAT)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # (found, never run: ftb-gpu is a lookup)
    for name in ("stat", "nvidia-smi"):
        (bin_dir / name).chmod(0o755)
    freeze, out = tmp_path / "freeze", shared / "rank.log"
    steps = tmp_path / "steps" / "a1.steps"
    steps.parent.mkdir()
    steps.with_name("a1.steps.0").write_text("0 25 0.0310 0.0400\n")
    env = {"FTB_RUN_DIR": str(shared), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(tmp_path / "job.log"),
           "FTB_EXIT": str(tmp_path / "node.exit"), "FTB_PIDFILE": str(tmp_path / "node.pid"),
           "FTB_HBFILE": str(tmp_path / "node.hb"), "FTB_STOPPED_FILE": str(tmp_path / "node.stopped"),
           "FTB_MARKER": f"ftb-test-protocol-{time.time_ns()}", "FTB_ATTEMPT": "1",
           "FTB_WATCHDOG": "30", "FTB_HEARTBEAT": "0.2", "FTB_STOP_GRACE": "1", "FTB_DETACH": "0",
           "FTB_PROGRESS_FILES": f"{shared}/*.log", "FTB_PROGRESS_EVERY": "1", "FTB_SHARED_DIR": str(shared),
           "FTB_STORAGE_SLOW": "1", "FTB_STEPS_FILE": str(steps)}
    job = f"while [ ! -e {tmp_path}/end ]; do echo step >> {out}; sleep 0.1; done; exit 3"
    proc = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sh", "-c", job],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                                 "FROZEN": str(shared), "FREEZE": str(freeze)})
    raw: list[bytes] = []
    reader = threading.Thread(target=lambda: raw.extend(line.rstrip(b"\n") for line in proc.stderr), daemon=True)
    reader.start()

    def seen(prefix: bytes, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(prefix) for line in list(raw)):
            assert time.monotonic() < deadline, f"no {prefix!r} in {timeout}s: {raw}"
            time.sleep(0.05)

    try:
        proc.stdin.write(protocol.env_payload(env))
        proc.stdin.flush()
        seen(b"ftb-steps ")
        freeze.touch()  # the next reading of the storage waits
        seen(b"ftb-storage ")
        freeze.unlink()
        seen(b"ftb-storage ok")
        (tmp_path / "end").touch()
        code = proc.wait(timeout=20)
    finally:
        freeze.unlink(missing_ok=True)
        (tmp_path / "end").touch()
        proc.kill()
    reader.join(5)
    proc.stdin.close()
    assert code == 3, raw

    lines = [parse_line(line) for line in raw]
    kinds = [line.kind for line in lines]
    assert kinds[:2] == [protocol.GPU_LINE, protocol.PID_LINE], raw  # (said before the first beat)
    assert lines[1].text.isdigit()
    assert {protocol.HB_LINE, protocol.STEPS_LINE, protocol.STORAGE_LINE} <= set(kinds), raw
    assert protocol.MESSAGE not in kinds, raw  # nothing it said is outside the protocol
    readings = [parse_progress(line.text) for line in lines if line.kind == protocol.HB_LINE]
    assert all(r is None or (r[0] >= 0 and r[1] is None) for r in readings), readings
    sizes = [r[0] for r in readings if r is not None]
    assert sizes and sizes == sorted(sizes) and sizes[-1] > sizes[0], sizes  # the ranks' output grew
    assert parse_steps(next(line.text for line in lines if line.kind == protocol.STEPS_LINE)) == [
        RankSteps(0, 25, 0.031, 0.04)]
    reports = [parse_storage(line.text) for line in lines if line.kind == protocol.STORAGE_LINE]
    assert None not in reports, reports
    assert not reports[0].ok and reports[0].seconds >= 1 and reports[-1].ok, reports


def test_a_keyword_counts_only_as_the_lines_first_word():
    assert parse_line(b"ftb-hb") == protocol.Line(protocol.HB_LINE, "")
    assert parse_line(b"ftb-hb 120 7") == protocol.Line(protocol.HB_LINE, "120 7")
    assert parse_progress("120 7") == (120, 7) and parse_progress("") is None and parse_progress("x") is None
    assert parse_line(b"ftb-gpu").kind == protocol.GPU_LINE
    assert parse_line(b"ftb-gpu 2").kind == protocol.MESSAGE  # (not the node program's word)
    assert parse_line(b"ftbundle: launcher lost").kind == protocol.MESSAGE
    assert parse_line(b"my job says ftb-hb 5") == protocol.Line(protocol.MESSAGE, "my job says ftb-hb 5")
    assert parse_line(b"ftb-hbx").kind == protocol.MESSAGE
    assert parse_line(b"\xff\xfe").kind == protocol.MESSAGE  # (undecodable: still one message, no error)


def test_storage_reports_parse():
    assert parse_storage("ok").ok
    assert parse_storage("7") == protocol.StorageReport(False, 7.0, "S")
    assert parse_storage("9 R - 140.5") == protocol.StorageReport(False, 9.0, "R", "-", 140.5)
    assert parse_storage("9 - - ?") == protocol.StorageReport(False, 9.0, None, "-", None)
    assert parse_storage("soon") is None and parse_storage("9 R") is None


def test_the_node_program_says_only_the_protocols_keywords_and_each_of_them():
    """Every `ftb-...` word node.sh echoes to the launcher is one protocol.py parses, and every
    keyword protocol.py names is said somewhere in node.sh."""
    text = NODE_SH.read_text()
    said = set(re.findall(r'echo "(ftb-[a-z]+)', text))
    assert said == set(protocol.KEYWORDS), said


def test_the_environment_payload_round_trips_through_bash(tmp_path):
    """What env_payload writes is what the node program's `read -d ''` takes apart, newlines in values too."""
    env = {"A": "1", "B": "two words", "C": "line\nbreak", "D": ""}
    script = 'while IFS= read -r -d "" kv; do [ -z "$kv" ] && break; printf "%s\\0" "$kv"; done'
    out = subprocess.run(["bash", "-c", script], input=protocol.env_payload(env), capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [f"{k}={v}".encode() for k, v in env.items()]
