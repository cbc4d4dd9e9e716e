"""`ftbundle logs --all` / `--rank`: the rank argument and the merge in time order (pure; on
containerized hosts: tests/cluster/test_logs_all.py)."""

from __future__ import annotations

import pytest

from ftbundle.runlogs import merge_by_time, parse_rank
from ftbundle.errors import UserError


def test_parse_rank_takes_a_global_rank_or_node_colon_local():
    assert parse_rank(None, 2, 4) == (0, 0)
    assert parse_rank("5", 2, 4) == (1, 1) and parse_rank("1:1", 2, 4) == (1, 1) and parse_rank("0", 2, 4) == (0, 0)
    for bad in ("8", "2:0", "0:4", "-1", "x", "1:"):
        with pytest.raises(UserError, match="give a global rank 0-7 or NODE:LOCAL"):
            parse_rank(bad, 2, 4)


def test_merge_by_time_orders_lines_across_files_and_keeps_untimed_lines_after_theirs():
    a = ["2026-11-24 10:00:01,000 a1", "2026-11-24 10:00:03,000 a3", "Traceback (most recent call last):",
         "ValueError: boom"]
    b = ["starting", "2026-11-24 10:00:02,000 b2", "2026-11-24 10:00:04,000 b4"]
    merged = merge_by_time([("h0:0", a), ("h1:2", b)])
    assert [line for _, line in merged] == [
        "2026-11-24 10:00:01,000 a1", "starting", "2026-11-24 10:00:02,000 b2", "2026-11-24 10:00:03,000 a3",
        "Traceback (most recent call last):", "ValueError: boom", "2026-11-24 10:00:04,000 b4"]
    assert merged[4] == ("h0:0", "Traceback (most recent call last):")
