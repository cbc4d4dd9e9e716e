"""The package's floors import one way: job + hosts -> layout -> facts -> plan -> launch -> report.

test_imports_unit.py proves no module imports itself back through others; this proves the same of
the floors: each subpackage of ftbundle (check/, launch/, export/, ui/, ...) and each
top-level module is one node, and no node reaches itself through the imports of its modules
(at any depth: inside functions and ``if TYPE_CHECKING:`` too). Then the rules a reader relies
on: the launcher, the plan and the run history know nothing of the preflight check (the GPU
health parsing and the fact types they share live below both: gpu_health.py, facts.py);
check/ may run its burn-in and network jobs through launch/, never the other way round.
"""

from __future__ import annotations

import pytest

from tests.unit.test_imports_unit import find_cycles, import_graph


def floor(module: str) -> str:
    """`ftbundle.check.rules` -> `check`; `ftbundle.plan` -> `plan`; `ftbundle` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_graph(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The floors and their imports of each other, and for each such edge the module imports
    that make it (`ftbundle.check.burnin -> ftbundle.launch`), for the messages."""
    floors: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        src = floors.setdefault(floor(module), set())
        for target in targets:
            dst = floor(target)
            if dst != floor(module):
                src.add(dst)
                why.setdefault((floor(module), dst), []).append(f"{module} -> {target}")
    return floors, why


def imports_from(floors_graph: dict[str, set[str]], why, source: str, target: str) -> list[str]:
    return sorted(why.get((source, target), [])) if target in floors_graph.get(source, ()) else []


def test_floor_graph_names_each_subpackage_and_module():
    graph = {"ftbundle": set(), "ftbundle.plan": {"ftbundle.facts"}, "ftbundle.facts": set(),
             "ftbundle.check": {"ftbundle.check.rules", "ftbundle.plan"},
             "ftbundle.check.rules": {"ftbundle.facts", "ftbundle.check"},
             "ftbundle.launch.supervisor": {"ftbundle.check.rules"}}
    floors, why = floor_graph(graph)
    assert floors == {"__init__": set(), "plan": {"facts"}, "facts": set(), "check": {"plan", "facts"},
                      "launch": {"check"}}
    assert why[("launch", "check")] == ["ftbundle.launch.supervisor -> ftbundle.check.rules"]
    assert find_cycles(floors) == []
    floors["plan"].add("launch")
    assert find_cycles(floors) == [["check", "launch", "plan"]]


def test_no_cycle_between_floors():
    floors, why = floor_graph(import_graph())
    assert {"check", "launch", "export", "ui", "plan", "history", "runs"} <= set(floors)
    cycles = find_cycles(floors)
    if cycles:
        lines = []
        for comp in cycles:
            members = set(comp)
            lines.append(f"  {', '.join(comp)}:")
            lines += [f"    {edge}" for (src, dst), edges in sorted(why.items())
                      if src in members and dst in members for edge in sorted(edges)]
        pytest.fail("subpackages and modules of ftbundle that import each other:\n" + "\n".join(lines),
                    pytrace=False)


@pytest.mark.parametrize("source", ["launch", "plan", "history", "runs", "runlogs"])
def test_below_the_check(source):
    """The launcher, the plan and the run history import nothing from check/ (the preflight):
    what they share with it (the fact types, the GPU health parsing) lives below both."""
    floors, why = floor_graph(import_graph())
    assert imports_from(floors, why, source, "check") == []


ROOM_LIMIT = 600  # issue 44 item 4: no module under ftbundle/ (Python or shell) over this many lines


def rooms_over(root, limit: int) -> list[str]:
    return sorted(f"{p.relative_to(root.parent)}: {n} lines" for p in root.rglob("*")
                  if p.suffix in (".py", ".sh") and (n := len(p.read_text().splitlines())) > limit)


def test_no_room_over_600_lines(tmp_path):
    """Every module the package ships, Python or shell, is at most 600 lines: the next feature
    lands in a room of its own. (The rule can fail: a copy with one module grown is caught.)"""
    from tests.support.helpers import REPO

    assert rooms_over(REPO / "ftbundle", ROOM_LIMIT) == []
    grown = tmp_path / "ftbundle"
    grown.mkdir()
    (grown / "big.py").write_text("x = 1\n" * (ROOM_LIMIT + 1))
    (grown / "small.sh").write_text("true\n" * ROOM_LIMIT)
    assert rooms_over(grown, ROOM_LIMIT) == [f"ftbundle/big.py: {ROOM_LIMIT + 1} lines"]
