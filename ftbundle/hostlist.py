"""Host lists folded into ranges for people to read: `gpu-[001-128,130]`.

Every report that names hosts (the check, `status`, `stop`, failure notes) says them through
:func:`fold`, so that 256 hosts take a few characters, not a screen. The notation and the
folding are ClusterShell's NodeSet (what `clush`, Slurm and pdsh users read every day).
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def natural(host: str) -> list:
    """A sort key for host names: node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", host)]


def fold(names: Iterable[str]) -> str:
    """``["gpu-001", "gpu-002", "gpu-004"]`` -> ``"gpu-[001-002,004]"`` (sorted, as NodeSet
    sorts). Names NodeSet would read otherwise (with brackets, commas, spaces, group or
    operator characters) are listed as they are, joined with ", ": the folded text always
    expands back to exactly the names given."""
    names = list(dict.fromkeys(str(n) for n in names))
    if len(names) <= 1:
        return names[0] if names else ""
    try:
        from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet

        folded = str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))
        if sorted(NodeSet(folded, resolver=RESOLVER_NOGROUP)) == sorted(names):
            return folded
    except Exception:  # a name NodeSet cannot parse: say the names as they are
        pass
    return ", ".join(names)


def fold_numbers(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: ranks as a range."""
    from ClusterShell.RangeSet import RangeSet

    values = sorted(set(int(n) for n in numbers))
    return str(RangeSet.fromlist([str(n) for n in values])) if values else ""
