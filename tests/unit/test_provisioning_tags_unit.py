"""docs/provisioning.md and site.yml agree on the tags: every documented tag selects tasks
of site.yml beyond preflight, and every tag site.yml has is documented. No host is
contacted (--list-tasks)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cluster.test_provisioning import BIN, run, tail

REPO = Path(__file__).resolve().parents[2]


def documented_tags() -> list[str]:
    text = (REPO / "docs" / "provisioning.md").read_text()
    sentence = re.search(r"`site\.yml` is tagged per phase: (.*?)\(tests/", text, re.S)
    assert sentence, "docs/provisioning.md no longer lists site.yml's tags"
    return [tag for tag in re.findall(r"`([a-z_]+)`", sentence.group(1)) if tag != "always"]


def test_documented_tags_are_site_ymls_and_each_selects_tasks():
    proc = run([str(BIN / "ansible-playbook"), "-i", "tests/data/tags-inventory.yml", "site.yml", "--list-tasks"],
               timeout=120)
    assert proc.returncode == 0, tail(proc)
    selects: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        m = re.search(r"^\s+(.*?)\s+TAGS: \[(.*)\]$", line)
        if m and not m.group(1).startswith("preflight"):
            for tag in filter(None, (t.strip() for t in m.group(2).split(","))):
                selects[tag] = selects.get(tag, 0) + 1
    selects.pop("always", None)
    docs = documented_tags()
    assert set(docs) == set(selects) | {"preflight"}, f"documented {sorted(docs)}, site.yml tags tasks {sorted(selects)}"
    assert all(selects.get(tag) for tag in docs if tag != "preflight"), selects
