"""The files shipped inside the package (the node program, the probe, the shims), read from
beside this module. importlib.resources would do the same for an installed package, but
importing it costs ~7 ms of every start, before the first SSH
byte (docs/PERFORMANCE.md, fixed cost)."""

from __future__ import annotations

import os

_ROOT = os.path.dirname(os.path.abspath(__file__))


def read_bytes(directory: str, name: str) -> bytes:
    """``ftbundle/<directory>/<name>``'s bytes."""
    with open(os.path.join(_ROOT, directory, name), "rb") as f:
        return f.read()


def read_text(directory: str, name: str) -> str:
    return read_bytes(directory, name).decode("utf-8")
