"""Static checks of the Ansible code: ansible-lint's production profile and a syntax check of
every playbook. No hosts; marked `lint` (not part of `make unit`, which is for the quick
tests of the Python code; `make test` runs them)."""

from __future__ import annotations

import pytest

from tests.support.helpers import REPO
from tests.cluster.test_provisioning import BIN, run, tail

pytestmark = pytest.mark.lint


def test_ansible_lint_production_profile():
    proc = run([str(BIN / "ansible-lint"), "--offline", "site.yml", "playbooks", "roles", "molecule"], timeout=600)
    assert proc.returncode == 0, tail(proc)
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr, tail(proc)


def test_syntax_check_every_playbook():
    for playbook in ["site.yml", *sorted(str(p.relative_to(REPO)) for p in (REPO / "playbooks").glob("*.yml"))]:
        proc = run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", "inventory/hosts.yml", playbook],
                   timeout=120)
        assert proc.returncode == 0, f"{playbook}\n{tail(proc)}"
