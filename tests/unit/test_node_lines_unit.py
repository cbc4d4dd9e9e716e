"""Rank 0's bytes -> display lines: incremental UTF-8, carriage-return bars, bounded memory;
and the display that condenses rather than blocks."""

from __future__ import annotations

import io
import threading

from ftbundle.launch import node as N
from ftbundle.launch.display import Display


def split(chunks: list[bytes]) -> tuple[list[str], list[str]]:
    lines, bars = [], []
    s = N.LineSplitter(lines.append, bars.append)
    for chunk in chunks:
        s.feed(chunk)
    s.close()
    return lines, bars


def test_utf8_split_across_chunks_is_decoded_whole():
    data = "naïve ✓ 日本\n".encode()
    lines, _ = split([data[i:i + 1] for i in range(len(data))])
    assert lines == ["naïve ✓ 日本"]


def test_carriage_return_bar_ends_on_its_last_state(monkeypatch):
    monkeypatch.setattr(N, "PROGRESS_EVERY_S", 0.0)
    lines, bars = split([b" 10%|#  |\r", b" 50%|## |\r", b"100%|###|\n", b"loss 1.0\n"])
    assert lines == ["100%|###|", "loss 1.0"]
    assert bars and bars[-1] == " 50%|## |"  # the bar's latest state while it was redrawn


def test_bar_updates_are_throttled(monkeypatch):
    monkeypatch.setattr(N, "PROGRESS_EVERY_S", 3600.0)
    _, bars = split([f"{i}%\r".encode() for i in range(100)])
    assert len(bars) == 1


def test_a_line_without_end_is_cut_not_kept():
    lines, _ = split([b"x" * (N.LINE_MAX // 4)] * 8 + [b"\n"])
    assert sum(len(line) for line in lines) == 2 * N.LINE_MAX and len(lines) == 2
    assert all(set(line) == {"x"} and len(line) <= N.LINE_MAX + N.LINE_MAX // 4 for line in lines)


def test_last_line_without_newline_is_shown():
    assert split([b"a\nb"])[0] == ["a", "b"]


class SlowOut(io.StringIO):
    """A terminal that is stuck until released."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def write(self, text):
        self.release.wait()
        return super().write(text)


def test_display_drops_and_says_so_instead_of_blocking():
    out = SlowOut()
    d = Display(out, capacity=100, log_hint="/shared/runs/r/node-0-h.a1.log")
    for i in range(10_000):  # returns at once although nothing can be written
        d.line(f"line {i}")
    out.release.set()
    assert d.flush(timeout=10)
    d.close()
    text = out.getvalue()
    assert "line 9999" in text
    assert "not shown: the terminal fell behind (full log: /shared/runs/r/node-0-h.a1.log)" in text
    assert d.lines_dropped > 9000 and d.lines_shown + d.lines_dropped == 10_000


def test_display_takes_a_reads_lines_at_once_and_drops_the_oldest_as_line_does():
    out = SlowOut()
    d = Display(out, capacity=100)
    sizes = [1, 37, 250, 3000, 99, 100, 101]
    n = 0
    while n < 10_000:  # returns at once although nothing can be written
        size = min(sizes[n % len(sizes)], 10_000 - n)
        d.lines("[h r0] ", [f"line {i}" for i in range(n, n + size)])
        n += size
    out.release.set()
    assert d.flush(timeout=10)
    d.close()
    shown = [int(line.split()[-1]) for line in out.getvalue().splitlines() if line.startswith("[h r0] line ")]
    assert shown == sorted(shown) and shown[-100:] == list(range(9900, 10_000))  # the newest, in order
    assert "not shown: the terminal fell behind" in out.getvalue()
    assert d.lines_shown == len(shown) and d.lines_shown + d.lines_dropped == 10_000


def test_display_redacts():
    out = io.StringIO()
    d = Display(out, redact=lambda s: s.replace("hunter2", "<redacted>"))
    d.line("token hunter2")
    d.close()
    assert out.getvalue() == "token <redacted>\n"


def test_stop_grace_is_wall_time_even_when_each_look_at_proc_is_slow(tmp_path):
    """node.sh's stop: SIGTERM, then SIGKILL once the grace period (wall time) is over. On a
    loaded host every scan of /proc is slow; here each `grep` is made to take 0.3 s, and a
    job that ignores SIGTERM must still be killed about 1 s (FTB_STOP_GRACE) after the stop,
    not after 10 slow scans (the grace used to be counted in scans)."""
    import os
    import secrets
    import subprocess
    import time

    marker = f"ftb-test-{secrets.token_hex(4)}"
    shim = tmp_path / "bin"
    shim.mkdir()
    real_grep = subprocess.run(["bash", "-c", "command -v grep"], capture_output=True, text=True).stdout.strip()
    (shim / "grep").write_text(f"#!/bin/sh\nsleep 0.3\nexec {real_grep} \"$@\"\n")
    (shim / "grep").chmod(0o755)
    job = subprocess.Popen(["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"],
                           env=dict(os.environ, FTB_JOB=marker), start_new_session=True)
    try:
        time.sleep(0.2)
        env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", FTB_STOP_GRACE="1")
        started = time.monotonic()
        stop = subprocess.run(N.node_argv("stop", marker, ""), env=env, capture_output=True, text=True, timeout=30)
        took = time.monotonic() - started
        assert job.wait(timeout=5) == -9  # SIGKILLed: it ignored SIGTERM
        assert stop.returncode == 0, stop.stderr
        assert took < 3.5, f"stop took {took:.1f}s for a 1 s grace"  # 1 s + a few 0.3 s scans (was 5 s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
