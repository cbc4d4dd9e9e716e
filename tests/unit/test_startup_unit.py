"""What a start imports before its first SSH byte (issue 23, item 1: 1-2 hosts, where
Python's fixed cost is most of the start). Each test runs a fresh interpreter: the import
state of this one (pytest has unittest.mock, importlib.metadata) would hide it all.

ftbundle/ssh.py's load_fabric stands in for two standard modules that Fabric's dependencies
import but no connection uses (unittest.mock under invoke.context, importlib.metadata in
paramiko's __init__), and gives Invoke the PyYAML ftbundle already has instead of its
vendored copy; ftbundle reads its shipped files without importlib.resources. These tests
hold both halves: the modules are not imported, and what used them still answers the same.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import REPO

NOT_ON_THE_LAUNCH_PATH = ["unittest", "unittest.mock", "asyncio", "ssl", "importlib.metadata", "email",
                          "zipfile", "invoke.vendor.yaml.reader", "importlib.resources",
                          "ftbundle.export", "ftbundle.commands.export", "ftbundle.commands.init"]


def fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter at the repository root; the JSON it prints last."""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_start_imports_none_of_what_no_connection_uses():
    loaded = fresh(
        "import json, sys\n"
        "import ftbundle.cli\n"
        "from ftbundle.ssh import load_fabric\n"
        "load_fabric()\n"
        "import ftbundle.launch, ftbundle.ui, ftbundle.check, ftbundle.commands.run, ftbundle.launch.resume\n"
        # every shipped file, read as a launch reads it
        "from ftbundle.launch.node import program\n"
        "from ftbundle.launch.stall import collector_source\n"
        "from ftbundle.check import probe_source\n"
        "from ftbundle.check.net import bench_source\n"
        "from ftbundle.runtimes import llamafactory_entry_source\n"
        "assert program().startswith('# ftbundle') and b'def main' in probe_source()\n"
        "assert collector_source() and bench_source() and llamafactory_entry_source()\n"
        f"print(json.dumps([m for m in {NOT_ON_THE_LAUNCH_PATH!r} if m in sys.modules]))\n")
    assert loaded == []


def test_what_used_the_stand_ins_answers_as_before(tmp_path):
    (tmp_path / "fabric.yaml").write_text("run:\n  echo: true\n  warn: true\n")
    seen = fresh(
        "import json, sys\n"
        "from ftbundle.ssh import load_fabric, _version\n"
        "fabric = load_fabric()\n"
        "import invoke, invoke.context, invoke.util, paramiko, yaml\n"
        "standins_gone = not any(type(sys.modules.get(m)).__name__ == '_StandIn' "
        "for m in ('unittest.mock', 'importlib.metadata'))\n"
        # Invoke's config files go through PyYAML (ftbundle's), as on a distribution that unvendors it
        f"config = fabric.Config(project_location={str(tmp_path)!r}); config.load_project()\n"
        # MockContext (a test helper) gets unittest.mock's real Mock on first use
        "mock_run = invoke.MockContext(run={'hostname': invoke.Result('node0')}).run\n"
        "said = mock_run('hostname').stdout\n"
        "import unittest.mock, importlib.metadata as md\n"
        "names = ['paramiko', 'invoke', 'fabric', 'PyYAML', 'pyyaml', 'cryptography', 'PyNaCl', 'bcrypt',\n"
        "         'typing_extensions', 'typing-extensions', 'Typing.Extensions']  # (spelt as users spell them)\n"
        "try:\n"
        "    _version('no-such-package-ftb')\n"
        "    missing = 'found'\n"
        "except md.PackageNotFoundError:\n"
        "    missing = 'PackageNotFoundError'\n"
        "print(json.dumps({'gone': standins_gone, 'paramiko': paramiko.__version__,\n"
        "                  'real': md.version('paramiko'), 'ours': {n: _version(n) for n in names},\n"
        "                  'theirs': {n: md.version(n) for n in names}, 'missing': missing,\n"
        "                  'yaml': invoke.util.yaml is yaml, 'echo': config.run.echo, 'warn': config.run.warn,\n"
        "                  'said': said, 'mock': type(mock_run).__module__,\n"
        "                  'real_mock': hasattr(unittest.mock, 'patch')\n"
        "                               and type(unittest.mock).__name__ == 'module'}))\n")
    assert seen["gone"]
    assert seen["paramiko"] == seen["real"]
    assert seen["ours"] == seen["theirs"]
    assert seen["missing"] == "PackageNotFoundError"
    assert seen["yaml"] and seen["echo"] is True and seen["warn"] is True
    assert seen["said"] == "node0" and seen["mock"] == "unittest.mock"
    assert seen["real_mock"]


def test_a_module_already_imported_is_left_alone_and_any_other_name_is_the_real_ones():
    seen = fresh(
        "import json, sys\n"
        "import unittest.mock\n"  # (a test runner, or a user's program that imported it first)
        "from ftbundle.ssh import _standing_in, load_fabric\n"
        "with _standing_in():\n"
        "    import importlib.metadata as during\n"
        "    standin = type(during).__name__\n"
        "    entry_points = during.entry_points  # not a name the stand-in answers: the real module's\n"
        "load_fabric()\n"
        "import invoke.context, importlib.metadata as after\n"
        "print(json.dumps({'mock': invoke.context.Mock is unittest.mock.Mock, 'standin': standin,\n"
        "                  'entry_points': entry_points is after.entry_points,\n"
        "                  'after': type(after).__name__}))\n")
    assert seen == {"mock": True, "standin": "_StandIn", "entry_points": True, "after": "module"}


def test_every_subcommand_resolves_to_its_function():
    """The CLI imports a subcommand's module only when it runs: each name it holds must be
    a function of that module (a typo would otherwise surface only when a user runs it)."""
    import argparse

    from ftbundle import cli

    with pytest.raises(SystemExit):
        cli.main(["--version"])  # (builds the parser, kept in cli._PARSER for completion)
    captured = {"parser": cli._PARSER}
    subparsers = next(a for a in captured["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    funcs = {name: p.get_default("func") for name, p in subparsers.choices.items()}
    assert set(funcs) >= {"run", "check", "status", "logs", "stop", "stacks", "export", "runs", "plot", "init"}
    for name, func in funcs.items():
        resolved = cli._command(func)
        assert callable(resolved), name
        assert resolved.__name__ == (func.partition(":")[2] if isinstance(func, str) else func.__name__), name
