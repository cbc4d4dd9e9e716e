"""The check's report: hosts grouped by value, a rich table on a terminal, plain text otherwise."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from ..hostlist import fold
from .rules import Check


@dataclass
class CheckReport:
    checks: list[Check]
    seconds: float = 0.0
    title: str = ""

    @property
    def failures(self) -> list[str]:
        return [m for c in self.checks for m in c.messages()]

    @property
    def warnings(self) -> list[str]:
        return [w for c in self.checks for w in c.warnings]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def format_report(report: CheckReport) -> list[str]:
    """One block per check: `label  value: hosts`, a line per group; failures start with
    FAIL and list what is wrong where."""
    lines = [report.title] if report.title else []
    width = 12
    for c in report.checks:
        if not c.ok:
            lines.append(f"FAIL {c.failure}:")
            lines += [f"  {value}: {fold(hosts)}" for value, hosts in c.groups]
            lines += [f"  - {detail}" for detail in c.details]
        else:
            label = c.label or c.name
            if len(label) >= width:  # a long subject gets a line of its own
                lines.append(label)
                label = ""
            for value, hosts in c.groups:
                lines.append(f"{label:<{width}}{value}: {fold(hosts)}")
                label = ""
        lines += [f"{'':<{width}}note: {note}" for note in c.notes]
        lines += [f"WARN {warning}" for warning in c.warnings]
    failed = [c for c in report.checks if not c.ok]
    lines.append(f"all {len(report.checks)} checks passed in {report.seconds:.1f}s" if not failed else
                 f"{len(failed)} of {len(report.checks)} checks failed in {report.seconds:.1f}s: "
                 + ", ".join(c.name for c in failed))
    return lines


def print_report(report: CheckReport, out: TextIO | None = None) -> None:
    """A table on a terminal (rich), plain lines otherwise (logs, pipes, tests)."""
    out = out or sys.stdout  # looked up now: callers (and tests) may swap sys.stdout
    if getattr(out, "isatty", lambda: False)():
        print_table(report, out)
        return
    for line in format_report(report):
        print(line, file=out)
    out.flush()


def print_table(report: CheckReport, out: TextIO) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=report.title or None, show_lines=False, title_justify="left")
    table.add_column("check")
    table.add_column("value")
    table.add_column("hosts")
    for c in report.checks:
        style = None if c.ok else "bold red"
        for i, (value, hosts) in enumerate(c.groups):
            table.add_row(escape((c.label or c.name) if i == 0 else ""), escape(value), escape(fold(hosts)),
                          style=style)
        for detail in c.details:
            table.add_row("", f"[red]FAIL[/] {escape(detail)}", "")
        for warning in c.warnings:
            table.add_row("", f"[yellow]WARN[/] {escape(warning)}", "")
        for note in c.notes:
            table.add_row("", f"[dim]note: {escape(note)}[/]", "")
    console = Console(file=out, highlight=False)
    console.print(table)
    console.print(escape(format_report(report)[-1]))


