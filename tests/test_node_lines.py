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


def test_display_redacts():
    out = io.StringIO()
    d = Display(out, redact=lambda s: s.replace("hunter2", "<redacted>"))
    d.line("token hunter2")
    d.close()
    assert out.getvalue() == "token <redacted>\n"
