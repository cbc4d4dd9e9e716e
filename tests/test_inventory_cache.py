"""The inventory is parsed by Ansible once and cached until one of its files changes."""

from __future__ import annotations

import time

from ftbundle.inventory import _cache_dir, load_hosts

INVENTORY = """all:
  children:
    trainers:
      hosts:
        a: {ansible_host: 10.0.0.1, ftb_node_rank: 1}
        b: {ansible_host: 10.0.0.2, ftb_node_rank: 0}
"""


def test_cache_returns_ansibles_answer_and_follows_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    inv = tmp_path / "hosts.yml"
    inv.write_text(INVENTORY)
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text("ftb_shared_dir: /shared\n")
    fresh = load_hosts(inv, "trainers")
    cached_files = list(_cache_dir().glob("*.json"))
    assert len(cached_files) == 1 and oct(cached_files[0].stat().st_mode & 0o777) == "0o600"
    again = load_hosts(inv, "trainers")
    assert [h.name for h in again] == ["b", "a"] == [h.name for h in fresh]
    assert again == fresh and [h.vars for h in again] == [h.vars for h in fresh]
    assert again[0].vars["ftb_shared_dir"] == "/shared"

    # a changed group_vars file is a new answer, not the cached one
    time.sleep(0.01)
    (tmp_path / "group_vars" / "all.yml").write_text("ftb_shared_dir: /elsewhere\n")
    assert load_hosts(inv, "trainers")[0].vars["ftb_shared_dir"] == "/elsewhere"
    assert len(list(_cache_dir().glob("*.json"))) == 2


def test_dynamic_and_vaulted_inventories_are_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = tmp_path / "inventory"
    script.write_text('#!/bin/sh\necho \'{"trainers": {"hosts": ["x"]}, "_meta": {"hostvars": {}}}\'\n')
    script.chmod(0o755)
    assert [h.name for h in load_hosts(script, "trainers")] == ["x"]
    vaulted = tmp_path / "v" / "hosts.yml"
    vaulted.parent.mkdir()
    vaulted.write_text(INVENTORY + "  vars:\n    secret: !vault |\n      $ANSIBLE_VAULT;1.1;AES256\n      3031\n")
    try:
        load_hosts(vaulted, "trainers")
    except Exception:
        pass  # no vault password here: Ansible may refuse; what matters is that nothing is written
    assert not _cache_dir().exists() or list(_cache_dir().glob("*.json")) == []
