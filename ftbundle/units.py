"""Figures as people read them, shared by every layer (no imports)."""

from __future__ import annotations


def size_text(n: float) -> str:
    """Bytes in decimal units, as disks are sold and `df -H` says them: 9.4 MB, 126.0 TB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def release(version: str | None) -> tuple[int, ...]:
    """A version's leading numbers, as it is compared: "2.8.0+cu126" -> (2, 8, 0), "4.57.0.dev0"
    -> (4, 57, 0), "2.7rc1" -> (2, 7); () for none. (The hosts' packages, as the check read them.)"""
    numbers: list[int] = []
    for part in (version or "").split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        numbers.append(int(part[:digits]))
        if digits < len(part):
            break
    return tuple(numbers)
