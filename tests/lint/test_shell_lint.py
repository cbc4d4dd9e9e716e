"""shellcheck over the shell that ftbundle ships to every host: the node program
(ftbundle/remote/node.sh, issue 44 item 3) and every other .sh under ftbundle/. Marked `lint`
(`make test` runs it). Findings that are the program's intent (a list of PIDs split into words,
globs left unquoted, an awk program in single quotes) carry a `# shellcheck disable=` line with
the reason beside the command; anything new fails here."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.helpers import REPO

pytestmark = pytest.mark.lint

SHIPPED = sorted((REPO / "ftbundle").rglob("*.sh"))


@pytest.fixture(scope="module")
def shellcheck() -> str:
    """The shellcheck the project installs (.ci/shellcheck.sh prints its path)."""
    return subprocess.run(["bash", str(REPO / ".ci" / "shellcheck.sh")], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_node_program_is_among_the_shipped_shell():
    assert REPO / "ftbundle" / "remote" / "node.sh" in SHIPPED


@pytest.mark.parametrize("script", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_shell_passes_shellcheck(shellcheck, script):
    proc = subprocess.run([shellcheck, "-f", "gcc", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_here_finds_what_the_node_program_no_longer_has(shellcheck, tmp_path):
    """The check can fail: the `ls | grep` that resume-point had (SC2010) is found in a copy."""
    bad = tmp_path / "node.sh"
    bad.write_text((REPO / "ftbundle" / "remote" / "node.sh").read_text()
                   + "\nftb_old() { ls -1 -- \"$1\" | grep -E '^checkpoint-[0-9]+$'; }\n")
    proc = subprocess.run([shellcheck, "-f", "gcc", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "SC2010" in proc.stdout, proc.stdout
