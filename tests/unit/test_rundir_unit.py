"""The run directory's names have one owner (ftbundle/rundir.py): the launcher, history, runs,
status and the exports take them from it, and the node program receives every one it needs in
its environment. Pure; no hosts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ftbundle import rundir
from ftbundle.rundir import NODE_KINDS, NodeFiles, RunDir, node_glob, node_name, parse_node_name, runs_dir

PACKAGE = Path(rundir.__file__).resolve().parent

# what a run-directory name looks like when spelled out: the fixed names, and the node files'
# patterns (node-R.aN.KIND, watch.aN, stalled.aN, "-stall-detached", a `.a{attempt}` suffix)
FIXED = (rundir.PLAN, rundir.ATTEMPTS, rundir.SUMMARY, rundir.METRICS, rundir.STOP_REQUEST, rundir.STACKS_PROGRAM,
         rundir.LLAMAFACTORY_CONFIG, rundir.LLAMAFACTORY_ENTRY, rundir.STEPTIMES, rundir.DEEPSPEED_CONFIG,
         rundir.NCCL_TRACE_PREFIX, rundir.BURNIN_SCRIPT, rundir.BURNIN_RESULT, rundir.NET_BENCH_SCRIPT,
         rundir.NET_BENCH_RESULT, rundir.SHELL_NODE_FILE)
PATTERNS = re.compile(r"\.a\{|\.a\$|\.a\"?\$\{?FTB_ATTEMPT|watch\.a|stalled\.a|stall-detached|"
                      r"\.(?:" + "|".join(NODE_KINDS) + r")\b\"?$|%\.exit|%\.hb")


# names that look like the run directory's and are not in it
NOT_THE_RUN_DIRS = {("runtimes.py", ".steps")}  # (host_steps_file: the host's own /tmp, never shared storage)


def _python_literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module and the literal parts of its f-strings, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    shipped = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Attribute) and node.func.attr in ("read_bytes", "read_text")
               for arg in node.args}  # (the package's own files, ftbundle/remote/stacks.py: not the run dir's)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | shipped:
            found.append((node.lineno, node.value))
    return found


def _spelled(text: str) -> bool:
    # (the bare words "attempt" and "runs" are record keys and command names as well: not judged)
    return text in FIXED or bool(PATTERNS.search(text))


def test_no_run_directory_name_is_spelled_outside_rundir_py():
    """Every run-dir file name under ftbundle/ comes from rundir.py: a reader finds them in one file."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rundir.py" or "shims" in path.parts:  # (shims run inside the job: names by env)
            continue
        for line, text in _python_literals(path):
            if _spelled(text) and (path.name, text) not in NOT_THE_RUN_DIRS:
                offenders.append(f"{path.relative_to(PACKAGE)}:{line}: {text!r}")
    assert offenders == [], "\n".join(offenders)


def test_the_node_program_spells_no_run_directory_name():
    """node.sh builds no name in the run directory: every path arrives in its environment."""
    offenders = []
    for path in sorted(PACKAGE.joinpath("remote").glob("*.sh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            for name in FIXED + ("stalled.a", "watch.a", "-stall-detached", "${FTB_EXIT%.exit}", "${FTB_HBFILE%.hb}",
                                 "node-*.a", "node-0.a", ".stacked", ".progress\""):
                if name in code:
                    offenders.append(f"{path.name}:{number}: {name!r} in {code.strip()}")
    assert offenders == [], "\n".join(offenders)


def test_the_names_of_a_run_directory():
    run = RunDir.of("/shared/ftb", "job-20261128-010203-abcd")
    assert run.path == "/shared/ftb/runs/job-20261128-010203-abcd" == str(run)
    assert runs_dir("/shared/ftb") == "/shared/ftb/runs"
    assert run.shared_dir == "/shared/ftb"
    assert RunDir.at(run.path + "/") == run
    with pytest.raises(ValueError, match="not a run directory"):
        RunDir.at("/shared/ftb/job-1")
    assert run.plan.endswith("/plan.json") and run.summary.endswith("/summary.json")
    assert run.attempt.endswith("/attempt") and run.attempts.endswith("/attempts.json")
    assert run.stop_request.endswith("/stop-requested") and run.metrics.endswith("/metrics.jsonl")
    assert run.verdict(2) == run.path + "/watch.a2" and run.stalled(3) == run.path + "/stalled.a3"
    assert run.detached_stacks(2) == run.path + "/stacks/a2-stall-detached"
    assert run.rank_logs(4) == run.path + "/ranks/node-4"
    files = run.node(1, "n2", 3)
    assert files == NodeFiles.of(run.path, run.run_id, 1, "n2", 3)
    assert files.log == run.path + "/node-1-n2.a3.log"
    assert files.exit == run.path + "/node-1.a3.exit" and files.stopped == run.path + "/node-1.a3.stopped"
    assert files.marker == "job-20261128-010203-abcd.a3-1"
    assert node_name(1, 3, "xids") == "node-1.a3.xids" and node_glob(3, "steps") == "node-*.a3.steps"
    with pytest.raises(ValueError):
        node_name(1, 3, "exitt")


def test_every_node_file_name_parses_back():
    for kind in NODE_KINDS:
        assert parse_node_name(node_name(12, 3, kind)) == (12, 3, kind)
    assert parse_node_name("node-2-host-a.b.a4.log") == (2, 4, "log")
    assert parse_node_name("plan.json") is None and parse_node_name("node-1.a2.exitt") is None


def test_the_environment_the_node_program_gets_names_paths_in_the_run_directory():
    """Each name the node program and the detached watcher read lies in the run directory (a
    glob: every node's file of the attempt), and each node file kind has its variable."""
    run = RunDir.of("/s", "r1")
    env = {**run.env(2), **run.node(0, "h", 2).env()}
    for name, value in env.items():
        if name in ("FTB_MARKER", "FTB_RUN_DIR"):
            continue
        assert value.startswith(run.path + "/"), (name, value)
    assert env["FTB_PEER_EXIT_GLOB"] == "/s/runs/r1/node-*.a2.exit"
    node_vars = {"FTB_EXIT", "FTB_PIDFILE", "FTB_HBFILE", "FTB_STOPPED_FILE", "FTB_KEPT_STEPS_FILE", "FTB_XIDS_FILE",
                 "FTB_PROGRESS_FILE", "FTB_STACKED_FILE", "FTB_KEPT_GPUS_FILE"}
    assert node_vars <= set(env)
    assert {posixpath_kind(env[v]) for v in node_vars} == set(NODE_KINDS)


def posixpath_kind(path: str) -> str:
    return path.rsplit(".", 1)[1]


def test_the_launcher_gives_the_node_program_the_run_directorys_names(tmp_path):
    """launch/node.py's node_env carries rundir's names for that node and attempt (the node
    program builds none), and a referee flag only on node rank 0."""
    from ftbundle.inventory import load_hosts
    from ftbundle.job import load_job
    from ftbundle.launch.node import node_env
    from tests.support.helpers import plan_of

    (tmp_path / "hosts.yml").write_text("all:\n  hosts:\n    a: {ansible_host: 10.9.0.1}\n    b: {ansible_host: 10.9.0.2}\n")
    (tmp_path / "job.yaml").write_text("name: j\ninventory: hosts.yml\nshared_dir: /s\ntrain: {command: x}\n")
    plan = plan_of(load_job(tmp_path / "job.yaml"), load_hosts(tmp_path / "hosts.yml"))
    assert plan.rundir == RunDir.of("/s", plan.run_id)
    for node in plan.nodes:
        files = plan.node_files(node, 3)
        env = node_env(node, plan, files, 3, detach=True)
        assert {k: env[k] for k in files.env()} == files.env()
        assert {k: env[k] for k in plan.rundir.env(3)} == plan.rundir.env(3)
        assert env["FTB_STOPPED_FILE"] == f"/s/runs/{plan.run_id}/node-{node.rank}.a3.stopped"
        assert env["FTB_REFEREE"] == ("1" if node.rank == 0 else "0")
    assert plan.nodes[0].env["FTB_ATTEMPT_FILE"] == plan.rundir.attempt  # (a fenced rank reads it)
