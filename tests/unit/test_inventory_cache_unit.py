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

    # the same inventory written again (a tool that regenerates it before each run): still the cached answer
    inv.write_text(INVENTORY)
    assert load_hosts(inv, "trainers") == fresh and len(list(_cache_dir().glob("*.json"))) == 1

    # a changed group_vars file is a new answer, not the cached one
    time.sleep(0.01)
    (tmp_path / "group_vars" / "all.yml").write_text("ftb_shared_dir: /elsewhere\n")
    assert load_hosts(inv, "trainers")[0].vars["ftb_shared_dir"] == "/elsewhere"
    assert len(list(_cache_dir().glob("*.json"))) == 2


def test_a_dynamic_inventory_is_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = tmp_path / "inventory"
    script.write_text('#!/bin/sh\necho \'{"trainers": {"hosts": ["x"]}, "_meta": {"hostvars": {}}}\'\n')
    script.chmod(0o755)
    assert [h.name for h in load_hosts(script, "trainers")] == ["x"]
    assert not _cache_dir().exists() or list(_cache_dir().glob("*.json")) == []


def test_a_vaulted_inventory_loads_with_its_password_and_is_never_cached(tmp_path, monkeypatch):
    """A real vault value, decrypted with a real password file: the load succeeds (so the
    only thing between the decrypted secret and the cache is the vault exclusion)."""
    from ansible.parsing.vault import VaultLib, VaultSecret

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    password = tmp_path / "vault-pass"
    password.write_text("correct horse\n")
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(password))
    secret = "s3cret-token-4711"
    encrypted = VaultLib([("default", VaultSecret(b"correct horse"))]).encrypt(secret).decode()
    vaulted = tmp_path / "v" / "hosts.yml"
    vaulted.parent.mkdir()
    vaulted.write_text(INVENTORY + "  vars:\n    secret: !vault |\n"
                       + "".join(f"      {line}\n" for line in encrypted.splitlines()))
    for _ in range(2):  # the second load would be the cached one
        hosts = load_hosts(vaulted, "trainers")
        assert [h.name for h in hosts] == ["b", "a"] and hosts[0].vars["secret"] == secret
    cached = list(_cache_dir().glob("*.json")) if _cache_dir().exists() else []
    assert cached == [], [p.read_text()[:200] for p in cached]


def test_a_host_in_two_groups_is_one_machine_unless_it_is_given_two_addresses(tmp_path, monkeypatch):
    """A host in several groups is ordinary (trainers and a gpu group; its address set once, or the
    same twice): loaded. The same name given two addresses (issue 45: Ansible kept the last in
    silence) is refused naming both, in YAML and INI; the parser's set_variable is restored."""
    import pytest
    from ansible.inventory.data import InventoryData

    from ftbundle.errors import UserError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    original = InventoryData.set_variable
    same = tmp_path / "same.yml"
    same.write_text("all:\n  children:\n    trainers:\n      hosts:\n        a: {ansible_host: 10.0.0.1}\n"
                    "        b: {ansible_host: 10.0.0.2}\n    h100:\n      hosts:\n        a: {ansible_host: 10.0.0.1}\n"
                    "        b:\n")
    assert [(h.name, h.address) for h in load_hosts(same, "trainers")] == [("a", "10.0.0.1"), ("b", "10.0.0.2")]
    ini = tmp_path / "two.ini"
    ini.write_text("[trainers]\na ansible_host=10.0.0.1\n\n[spares]\na ansible_host=10.0.0.9 ansible_port=2222\n")
    with pytest.raises(UserError) as caught:
        load_hosts(ini, "trainers")
    said = str(caught.value)
    assert "a is given ansible_host 10.0.0.1 and also 10.0.0.9" in said and caught.value.key == "ansible_host", said
    assert "ansible_port" not in said  # set once: no conflict
    assert InventoryData.set_variable is original
