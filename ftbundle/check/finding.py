"""A finding of the check: hosts grouped by value, and why it failed (the type every rule
returns, apart so that the rules' rooms import it and not each other)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..hostlist import fold


def group_by_value(values: dict[str, str]) -> list[tuple[str, list[str]]]:
    """[(value, hosts)], the largest group first (ties: the group seen first), hosts in
    the order given (rank order). The odd ones out come last."""
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    order = list(groups)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), order.index(item[0])))


def describe_groups(groups: list[tuple[str, list[str]]]) -> str:
    """`value on a, b; other on c`: a grouping on one line, for failure messages."""
    return "; ".join(f"{value} on {fold(hosts)}" for value, hosts in groups)


def per_hosts(items: list[tuple[str, object, Callable[[str], str]]]) -> list[str]:
    """[(host, what, line(hosts))] -> one line per distinct ``what``, its hosts folded
    (`node[3-5,9]`): 35 hosts with the same problem make one line, not 35."""
    groups: dict[object, tuple[list[str], Callable[[str], str]]] = {}
    for host, what, line in items:
        groups.setdefault(what, ([], line))[0].append(host)
    return [line(fold(hosts)) for hosts, line in groups.values()]


@dataclass
class Check:
    """One line (or block) of the report: hosts grouped by value, and why it failed."""

    name: str
    groups: list[tuple[str, list[str]]]
    failure: str | None = None  # e.g. "versions differ"
    details: list[str] = field(default_factory=list)  # failure lines that name hosts
    notes: list[str] = field(default_factory=list)  # worth saying, not a failure
    warnings: list[str] = field(default_factory=list)  # worth acting on, not a failure
    label: str = ""  # the name as shown, with its subject ("route to 10.0.0.1")

    @property
    def ok(self) -> bool:
        return self.failure is None

    def messages(self) -> list[str]:
        """One self-contained line per failure, for CheckReport.failures."""
        if self.ok:
            return []
        if self.details:
            return [f"{self.name}: {d}" for d in self.details]
        return [f"{self.failure}: {describe_groups(self.groups)}"]
