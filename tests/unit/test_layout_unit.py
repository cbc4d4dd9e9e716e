"""tests/ itself: the folders by what their tests need (tests/conftest.py's FOLDER_MARKERS), and
LONGEST_FIRST naming real test modules (a renamed module would otherwise drop out of the
longest-first order without a word, and make test's slowest module could start last)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import FOLDER_MARKERS, LONGEST_FIRST, TESTS, layer_problems


def test_every_longest_first_entry_names_an_existing_test_module():
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"LONGEST_FIRST names no file under tests/: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    for name in LONGEST_FIRST:
        folder, _, file = name.partition("/")
        assert folder in FOLDER_MARKERS and file.startswith("test_") and file.endswith(".py"), name


def test_every_test_module_is_in_a_folder_of_what_it_needs():
    stray = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.glob("test_*.py"))
    assert not stray, f"test modules outside tests/{{{','.join(FOLDER_MARKERS)}}}/: {stray}"
    for folder in FOLDER_MARKERS:
        assert (TESTS / folder / "__init__.py").is_file(), folder
    unit_named = {p.name for p in (TESTS / "unit").glob("test_*.py")}
    assert unit_named and all(name.endswith("_unit.py") for name in unit_named), sorted(unit_named)


def fake_item(rel: str, *markers: str) -> SimpleNamespace:
    return SimpleNamespace(path=TESTS / rel, nodeid=f"tests/{rel}::test_x",
                           iter_markers=lambda: [SimpleNamespace(name=m) for m in (*markers, "timeout")])


@pytest.mark.parametrize("rel, markers", [
    ("unit/test_a_unit.py", ()),
    ("cluster/test_a.py", ("cluster",)),
    ("cluster/test_a.py", ("cluster", "train")),
    ("train/test_a.py", ("train",)),
    ("gpu/test_a.py", ("gpu",)),
    ("lint/test_a.py", ("lint",)),
])
def test_a_test_in_the_folder_of_its_markers_passes(rel, markers):
    assert layer_problems([fake_item(rel, *markers)]) == []


@pytest.mark.parametrize("rel, markers, words", [
    ("unit/test_a_unit.py", ("cluster",), "in tests/unit/ with markers ['cluster']; tests/unit/ needs none"),
    ("unit/test_a_unit.py", ("train",), "in tests/unit/ with markers ['train']"),
    ("cluster/test_a.py", (), "in tests/cluster/ with markers none; tests/cluster/ needs ['cluster']"),
    ("cluster/test_a.py", ("train",), "tests/cluster/ needs ['cluster'], allows ['cluster', 'train']"),
    ("train/test_a.py", ("cluster", "train"), "in tests/train/ with markers ['cluster', 'train']"),
    ("gpu/test_a.py", (), "tests/gpu/ needs ['gpu']"),
])
def test_a_test_in_another_folder_than_its_markers_say_is_named(rel, markers, words):
    (problem,) = layer_problems([fake_item(rel, *markers)])
    assert problem.startswith(f"tests/{rel}::test_x: ") and words in problem, problem


def test_a_module_outside_the_folders_is_left_to_the_folder_test_above():
    elsewhere = SimpleNamespace(path=Path("/elsewhere/test_a.py"), nodeid="test_a.py::test_x", iter_markers=lambda: [])
    assert layer_problems([elsewhere, fake_item("test_a.py", "cluster")]) == []
