"""`ftbundle init`: the starting files (the questions and the files' text: ftbundle/init.py)."""

from __future__ import annotations

import argparse


def cmd_init(args: argparse.Namespace) -> int:
    from ..init import run_init

    return run_init(args)
