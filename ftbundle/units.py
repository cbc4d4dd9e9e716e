"""Figures as people read them, shared by every layer (no imports)."""

from __future__ import annotations


def size_text(n: float) -> str:
    """Bytes in decimal units, as disks are sold and `df -H` says them: 9.4 MB, 126.0 TB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
