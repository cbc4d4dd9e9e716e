"""Hosts from the Ansible inventory, read through Ansible's own inventory API.

The launcher and the playbook must agree on what a host is, so there is no second parser
here: ``InventoryManager`` resolves groups, patterns, group_vars and host_vars exactly as
``ansible-playbook`` does. This module only turns Ansible's host objects into plain
:class:`Host` values in rank order.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Host:
    """One machine as the launcher needs it; ``vars`` keeps every other host var."""

    name: str
    address: str  # how the controller reaches it (ansible_host or the name)
    port: int = 22
    user: str | None = None
    key_file: str | None = None
    local: bool = False  # run with a local process, not over SSH
    known_hosts: str | None = None  # from ansible_ssh_common_args -o UserKnownHostsFile=
    vars: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def master_addr(self) -> str:
        """The address other hosts use to reach this one as rank 0: ``ftb_master_addr``,
        else ``ftb_address`` (the host on the cluster network), else how we reach it."""
        return str(self.vars.get("ftb_master_addr") or self.vars.get("ftb_address") or self.address)


def _is_local(name: str, hostvars: dict[str, Any]) -> bool:
    if hostvars.get("ansible_connection") == "local":
        return True
    address = str(hostvars.get("ansible_host") or name)
    if address in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _known_hosts_from_args(hostvars: dict[str, Any]) -> str | None:
    """Honour `-o UserKnownHostsFile=...` from the ssh args Ansible itself would use."""
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        words = shlex.split(str(hostvars.get(key) or ""))
        for i, word in enumerate(words):
            option = word
            if word == "-o" and i + 1 < len(words):
                option = words[i + 1]
            if option.startswith("UserKnownHostsFile="):
                return option.split("=", 1)[1].split()[0]
    return None


def localhost_only() -> list[Host]:
    """The embedded default: this machine, as rank 0 of a one-node job."""
    return [Host(name="localhost", address="127.0.0.1", local=True, vars={})]


def load_hosts(inventory: str | Path, pattern: str = "all") -> list[Host]:
    """Hosts matching ``pattern`` in rank order (``ftb_node_rank``, else inventory order)."""
    inventory = str(inventory)
    if not Path(inventory).exists():
        raise UserError("inventory not found", file=inventory)
    # Imported here: ansible is heavy and only needed when an inventory is used.
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    manager = InventoryManager(loader=loader, sources=[inventory])
    if not manager.list_hosts("all"):
        raise UserError("inventory has no hosts (or could not be parsed by Ansible)", file=inventory)
    variables = VariableManager(loader=loader, inventory=manager)
    matched = manager.get_hosts(pattern=pattern)
    if not matched:
        groups = sorted(g for g in manager.groups if g not in ("all", "ungrouped"))
        raise UserError(
            f"host pattern {pattern!r} matches no host; groups in this inventory: "
            + (", ".join(groups) or "(none)"),
            file=inventory,
            key="hosts",
        )

    hosts = []
    for ans_host in matched:
        hv = variables.get_vars(host=ans_host, include_hostvars=False)
        hv = {k: v for k, v in hv.items() if not k.startswith("ansible_facts")}
        name = ans_host.name
        port = hv.get("ansible_port") or hv.get("ansible_ssh_port") or 22
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise UserError(f"ansible_port of {name} is not a number: {port!r}", file=inventory) from None
        hosts.append(
            Host(
                name=name,
                address=str(hv.get("ansible_host") or name),
                port=port,
                user=hv.get("ansible_user") or hv.get("ansible_ssh_user"),
                key_file=hv.get("ansible_ssh_private_key_file") or hv.get("ansible_private_key_file"),
                local=_is_local(name, hv),
                known_hosts=_known_hosts_from_args(hv),
                vars=dict(hv),
            )
        )
    return order_by_rank(hosts, inventory)


def order_by_rank(hosts: list[Host], source: str = "inventory") -> list[Host]:
    """Inventory order, unless every host sets ``ftb_node_rank`` (a permutation of 0..n-1)."""
    ranked = [h for h in hosts if h.vars.get("ftb_node_rank") is not None]
    if not ranked:
        return list(hosts)
    if len(ranked) != len(hosts):
        missing = ", ".join(h.name for h in hosts if h not in ranked)
        raise UserError(
            f"ftb_node_rank is set on some hosts but not on: {missing}; set it on all or none",
            file=source, key="ftb_node_rank",
        )
    try:
        ranks = {h.name: int(h.vars["ftb_node_rank"]) for h in hosts}
    except (TypeError, ValueError):
        raise UserError("ftb_node_rank must be an integer", file=source, key="ftb_node_rank") from None
    if sorted(ranks.values()) != list(range(len(hosts))):
        listing = ", ".join(f"{n}={r}" for n, r in ranks.items())
        raise UserError(
            f"ftb_node_rank must number the hosts 0..{len(hosts) - 1} once each; got {listing}",
            file=source, key="ftb_node_rank",
        )
    return sorted(hosts, key=lambda h: ranks[h.name])
