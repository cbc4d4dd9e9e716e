""".ci/venv.sh fails on a failed install, and checks every module the tests would skip
without. Runs a copy of the script against a fake interpreter (the real .venv is shared and
must not be rebuilt by a test): pure, about a second."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO

# The fake base interpreter: `-m venv DIR` makes DIR/bin/python, a fake whose pip install
# of the project prints what pip prints on a failure and exits 1; everything else succeeds.
FAKE_PYTHON = r'''#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin"
    cat >"$3/bin/python" <<'EOF'
#!/usr/bin/env bash
echo "$*" >>"$(dirname "$0")/calls"
if [ "$1 $2 $3" = "-m pip install" ] && [ "$4 $5" = "-q -e" ]; then
    echo "ERROR: Could not find a version that satisfies the requirement llamafactory==0.9.5" >&2
    exit 1
fi
exit 0
EOF
    chmod +x "$3/bin/python"
    exit 0
fi
exec "$REAL_PYTHON" "$@"
'''


def test_venv_script_fails_when_pip_install_fails(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "venv.sh", tmp_path / ".ci" / "venv.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    fake = tmp_path / "fake-python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(tmp_path / ".ci" / "venv.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "REAL_PYTHON": sys.executable})
    calls = (tmp_path / ".venv" / "bin" / "calls").read_text()
    assert "-m pip install -q -e" in calls, calls  # it got as far as the install
    assert p.returncode != 0, p.stdout + p.stderr
    assert "Could not find a version" in p.stdout + p.stderr  # pip's own message is shown
    assert not (tmp_path / ".venv" / ".ftbundle-deps").exists()  # no stamp: the next run tries again


def test_venv_script_checks_every_module_a_test_may_skip_without():
    """A module that a test imports with importorskip, missing from the script's import
    check, would turn a broken install into skipped tests instead of a failure."""
    checked_line = re.search(r"\.venv/bin/python -c 'import ([^']+)'", (REPO / ".ci" / "venv.sh").read_text())
    assert checked_line, "no import check in .ci/venv.sh"
    checked = {m.strip() for m in checked_line.group(1).split(",")}
    skipped = set()
    for path in (REPO / "tests").rglob("*.py"):  # (every folder of tests/)
        skipped |= set(re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", path.read_text()))
    assert skipped, "no importorskip found: the pattern is stale"
    assert {s.split(".")[0] for s in skipped} <= checked, sorted(skipped - checked)


def fake_apt(tmp_path: Path) -> tuple[Path, Path]:
    """A bin directory whose apt-get only records its arguments (and nothing else: the
    commands the scripts look for are all missing there)."""
    bin_dir, log = tmp_path / "fakebin", tmp_path / "apt.log"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f'#!/bin/bash\necho "$*" >>{log}\n')
    (bin_dir / "apt-get").chmod(0o755)
    (bin_dir / "flock").symlink_to(shutil.which("flock"))  # (apt.sh serializes installs with it)
    return bin_dir, log


def apt_words(log: Path) -> list[str]:
    """What apt-get was asked, without the options every call carries (-o NAME=VALUE)."""
    words = log.read_text().split()
    while words[:1] == ["-o"]:
        assert words[1] == "DPkg::Lock::Timeout=600", words  # waits for another apt, never fails on its lock
        words = words[2:]
    return words


def test_two_installs_at_once_run_one_after_the_other(tmp_path):
    """make test's workers (and a second checkout) may each find a package missing at once:
    on a fresh machine two registries started together, the second apt-get failed on dpkg's
    lock and a whole module errored. apt.sh's installs take one lock, machine-wide."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    (bin_dir / "apt-get").write_text(f'#!/bin/bash\necho "start $*" >>{log}; sleep 0.5; echo "end $*" >>{log}\n')
    (bin_dir / "apt-get").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FTB_APT_LOCK": str(tmp_path / "apt.lock")}
    procs = [subprocess.Popen(["bash", "-c", f". {REPO / '.ci' / 'apt.sh'}; ftb_install pkg{i}"], env=env,
                              stderr=subprocess.DEVNULL) for i in range(3)]
    assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
    events = [line.split()[0] for line in log.read_text().splitlines()]
    assert events == ["start", "end"] * 3, log.read_text()  # never two apt-gets at once


def test_tools_script_installs_what_the_tests_drive_when_missing(tmp_path):
    bin_dir, log = fake_apt(tmp_path)
    p = subprocess.run(["/bin/bash", str(REPO / ".ci" / "tools.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(bin_dir), "FTB_APT_LOCK": str(tmp_path / "apt.lock")})
    assert p.returncode == 0, p.stderr
    installed = apt_words(log)
    assert installed[:3] == ["install", "-y", "-q"], installed
    assert set(installed[3:]) == {"tmux", "curl", "openssh-client", "docker-registry", "shellcheck", "pdsh"}, installed
    # where they are present, nothing is installed
    log.unlink()
    for cmd in ("tmux", "curl", "ssh", "ssh-keygen", "docker-registry", "shellcheck", "pdsh"):
        (bin_dir / cmd).write_text("#!/bin/sh\n")
        (bin_dir / cmd).chmod(0o755)
    p = subprocess.run(["/bin/bash", str(REPO / ".ci" / "tools.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(bin_dir), "FTB_APT_LOCK": str(tmp_path / "apt.lock")})
    assert p.returncode == 0 and not log.exists(), p.stderr


def test_venv_script_installs_python3_venv_when_the_interpreter_cannot_make_one(tmp_path):
    """Debian's python3 without python3-venv has no ensurepip: the script installs it first."""
    (tmp_path / ".ci").mkdir()
    for name in ("venv.sh", "apt.sh"):
        shutil.copy(REPO / ".ci" / name, tmp_path / ".ci" / name)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir, log = fake_apt(tmp_path)
    fake = tmp_path / "fake-python3"
    # no ensurepip (as before python3-venv), and `-m venv` fails as Debian's does without it
    fake.write_text('#!/bin/bash\ncase "$*" in *ensurepip*|"-m venv"*) exit 1;; esac\nexec "$REAL_PYTHON" "$@"\n')
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(tmp_path / ".ci" / "venv.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
                            "FTB_APT_LOCK": str(tmp_path / "apt.lock")})
    assert apt_words(log) == ["install", "-y", "-q", "python3-venv"], p.stderr
    assert p.returncode != 0  # this fake still cannot make a venv: the script stops there


def test_gpu_check_script_without_a_gpu_skips_the_gpu_tests_and_returns_its_three_files(tmp_path):
    """.ci/gpu-check.sh (docs/testing.md: the `gpu` tests on a lent GPU machine), here where
    there is no GPU, and no wheels (a checkout's .whl/ is for Python 3.12): the gpu tests are
    collected and skipped, the versions are read with the interpreter given, and what the
    device tool would return is there. Both GPU scripts pass shellcheck."""
    shellcheck = subprocess.run(["bash", str(REPO / ".ci" / "shellcheck.sh")], capture_output=True, text=True,
                                check=True).stdout.strip()
    lint = subprocess.run([shellcheck, str(REPO / ".ci" / "gpu-check.sh"), str(REPO / ".ci" / "gpu-wheels.sh")],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OUT=str(out), PY=sys.executable, WHEELS=str(tmp_path / "none"), PATH="/usr/bin:/bin")
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu-check.sh")], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "pytest.log", "recorded.tgz"]
    log = (out / "pytest.log").read_text()
    assert re.search(r"(\d+) skipped", log) and "no GPU here" in log, log
    assert "test_lora_on_the_gpu_shows_no_deprecated_variable_no_raw_bar_and_where_the_time_went SKIPPED" in log, log
    versions = (out / "env.txt").read_text()
    assert re.search(r"llamafactory +0\.9\.5 ", versions) and "FAILED" not in versions, versions
    assert "gpu-check: pytest exit 0" in proc.stdout
