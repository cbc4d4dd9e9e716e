"""Hosts from the Ansible inventory, read through Ansible's own inventory API.

The launcher and the playbook must agree on what a host is, so there is no second parser
here: ``InventoryManager`` resolves groups, patterns, group_vars and host_vars exactly as
``ansible-playbook`` does. This module only turns Ansible's host objects into plain
:class:`Host` values in rank order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import userfiles
from .errors import UserError

if TYPE_CHECKING:
    from .job import Job

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
    proxy_jump: str | None = None  # from ansible_ssh_common_args -o ProxyJump= / -J: a bastion
    # every host var, templated as Ansible does; hidden from repr (vault values live here)
    vars: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def master_addr(self) -> str:
        """The address other hosts use to reach this one as rank 0: ``ftb_master_addr``,
        else ``ftb_address`` (the host on the cluster network), else how we reach it."""
        return str(self.vars.get("ftb_master_addr") or self.vars.get("ftb_address") or self.address)


# Per-host settings of a job, as inventory host vars (what DeepSpeed's hostfile says with slots=).
NPROC_VAR = "ftb_nproc_per_node"  # this host's ranks, over the job's nproc_per_node
GPUS_VAR = "ftb_gpus"  # the GPUs of this host the job uses: its CUDA_VISIBLE_DEVICES
_GPU_ID = re.compile(r"^(?:[0-9]+|(?:GPU|MIG)-[0-9A-Za-z/-]+)$")


def host_nproc(host: Host, source: str) -> int | None:
    """``ftb_nproc_per_node`` of a host: its rank count (a whole number, 1 or more), or None."""
    value = host.vars.get(NPROC_VAR)
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= 1024:
        raise UserError(f"{NPROC_VAR} of {host.name} must be a whole number of ranks from 1 to 1024, "
                        f"got {value!r}", file=source, key=NPROC_VAR)
    return int(text)


def host_gpus(host: Host, source: str) -> tuple[str, ...] | None:
    """``ftb_gpus`` of a host: the GPUs its ranks use, as CUDA_VISIBLE_DEVICES names them
    (indices or GPU-/MIG- UUIDs; "0,1,2,3" or a list), or None."""
    value = host.vars.get(GPUS_VAR)
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    gpus = tuple(str(i).strip() for i in items)
    if (isinstance(value, bool) or not gpus or not all(_GPU_ID.match(g) for g in gpus)
            or len(set(gpus)) != len(gpus)):
        raise UserError(f"{GPUS_VAR} of {host.name} must list GPUs once each, as CUDA_VISIBLE_DEVICES names "
                        f"them: indices or UUIDs, e.g. \"0,1,2,3\"; got {value!r}", file=source, key=GPUS_VAR)
    return gpus


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


def _ssh_options(hostvars: dict[str, Any]) -> dict[str, str]:
    """`-o Name=value` and `-J host` from the ssh args Ansible itself would use."""
    options: dict[str, str] = {}
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        words = shlex.split(str(hostvars.get(key) or ""))
        for i, word in enumerate(words):
            option = word[2:] if word.startswith("-o") and len(word) > 2 else word
            if word == "-o" and i + 1 < len(words):
                option = words[i + 1]
            elif word == "-J" and i + 1 < len(words):
                option = f"ProxyJump={words[i + 1]}"
            name, sep, value = option.partition("=")
            if sep and name[:1].isalpha():
                options.setdefault(name.lower(), value.split()[0] if value.split() else value)
    return options


def localhost_only() -> list[Host]:
    """The embedded default: this machine, as rank 0 of a one-node job."""
    return [Host(name="localhost", address="127.0.0.1", local=True, vars={})]


def resolve_hosts(job: Job, inventory: str | None) -> list[Host]:
    """A job's hosts: `-i` wins over the job's `inventory:`; with neither, this machine alone."""
    source = inventory or job.inventory
    if source is None:
        if job.hosts not in ("all", "localhost"):
            raise UserError(f"hosts: {job.hosts!r} needs an inventory (job key 'inventory' or -i)",
                            file=str(job.path), key="hosts")
        return localhost_only()
    return load_hosts(source, job.hosts)


def load_hosts(inventory: str | Path, pattern: str = "all") -> list[Host]:
    """Hosts matching ``pattern`` in rank order (``ftb_node_rank``, else inventory order).

    Ansible's parse takes about half a second, most of a small launch's start-up; its
    result is cached (see :func:`_cache_key`) and reused while no inventory file changed.
    """
    inventory = str(inventory)
    if not Path(inventory).exists():
        raise UserError("inventory not found", file=inventory)
    if not Path(inventory).is_dir() and not os.access(inventory, os.X_OK):  # a file Ansible would parse
        userfiles.read_text(inventory, "inventory", limit=INVENTORY_MAX_BYTES)
    key = _cache_key(inventory, pattern)
    hosts = _cache_read(key) if key else None
    if hosts is None:
        hosts = _load_with_ansible(inventory, pattern)
        if key:
            _cache_write(key, hosts)
    return order_by_rank(hosts, inventory)


CACHE_VERSION = 3


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ftbundle" / "inventory"


def _cache_key(inventory: str, pattern: str) -> str | None:
    """A hash of everything Ansible's answer depends on: the inventory files (a file, or a
    directory's tree) with group_vars/ and host_vars/ beside them, each by its content (a
    file of 1 MiB or more: its mtime and size), the pattern, the ANSIBLE_* environment and
    ansible.cfg. By content, so an inventory written again unchanged (a provisioning tool
    that regenerates it before every run) is not parsed again. None (no caching) for
    inventories whose answer can change without a file changing (executable scripts,
    plugin configs) or that hold vault-encrypted values (never written to disk in clear).
    """
    if os.environ.get("FTB_NO_INVENTORY_CACHE"):
        return None
    root = Path(inventory).resolve()
    base = root if root.is_dir() else root.parent
    paths = [root] + [base / d for d in ("group_vars", "host_vars") if (base / d).exists()]
    files = []
    for path in paths:
        walk = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in walk:
            st = f.stat()
            if st.st_mode & 0o111:
                return None  # Ansible runs an executable inventory file: a dynamic inventory
            if st.st_size < 1 << 20:
                text = f.read_bytes()
                if b"$ANSIBLE_VAULT" in text or re.search(rb"(?m)^plugin\s*:", text):
                    return None
                files.append((str(f), hashlib.sha256(text).hexdigest()))
            else:
                files.append((str(f), st.st_mtime_ns, st.st_size))
    cfg = [(c, os.stat(c).st_mtime_ns) for c in ("ansible.cfg", os.path.expanduser("~/.ansible.cfg"))
           if os.path.exists(c)]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("ANSIBLE_"))
    blob = json.dumps([CACHE_VERSION, str(root), pattern, files, cfg, env, os.getcwd()])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _cache_read(key: str) -> list[Host] | None:
    try:
        entries = json.loads((_cache_dir() / f"{key}.json").read_text())
        return [Host(**entry) for entry in entries]
    except (OSError, ValueError, TypeError):
        return None


def _cache_write(key: str, hosts: list[Host]) -> None:
    """Written only when every value is plain data; private to the user (mode 0600)."""
    try:
        text = json.dumps([dataclasses.asdict(h) for h in hosts])
    except (TypeError, ValueError):
        return
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, directory / f"{key}.json")
    except OSError:
        pass


def _load_with_ansible(inventory: str, pattern: str) -> list[Host]:
    # Imported here: ansible is heavy and only needed when an inventory is used.
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    _vault_secrets(loader, inventory)
    try:
        with _parse_failures() as failures, _address_conflicts() as conflicts:
            manager = InventoryManager(loader=loader, sources=[inventory])
        if conflicts:
            raise UserError(_conflict_words(conflicts), file=inventory, key=conflicts[0][1])
        if not manager.list_hosts("all"):
            raise UserError(_why_no_hosts(inventory, failures), file=inventory)
        variables = VariableManager(loader=loader, inventory=manager)
        matched = manager.get_hosts(pattern=pattern)
    except AnsibleError as exc:
        raise UserError(f"Ansible cannot read the inventory: {exc.message}", file=inventory) from None
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
        raw = variables.get_vars(host=ans_host, include_hostvars=False)
        raw = {k: v for k, v in raw.items() if not k.startswith("ansible_facts")}
        name = ans_host.name
        try:  # templated as ansible-playbook would: `ftb_address: "{{ ansible_host }}"`
            hv = Templar(loader=loader, variables=raw).template(raw)
        except AnsibleError as exc:
            raise UserError(f"a host var of {name} cannot be templated: {exc.message}", file=inventory) from None
        port = hv.get("ansible_port") or hv.get("ansible_ssh_port") or 22
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise UserError(f"ansible_port of {name} is not a number: {port!r}", file=inventory,
                            key="ansible_port") from None
        if not 1 <= port <= 65535:
            raise UserError(f"ansible_port of {name} is {port}: a TCP port is 1 to 65535 (sshd listens on 22 unless "
                            "told otherwise)", file=inventory, key="ansible_port")
        if "ansible_host" in hv and not str(hv.get("ansible_host") or "").strip():
            raise UserError(f"ansible_host of {name} is empty: give its address (an IP or a DNS name), or remove the "
                            "key to use the name itself", file=inventory, key="ansible_host")
        options = _ssh_options(hv)
        hosts.append(
            Host(
                name=name,
                address=str(hv.get("ansible_host") or name),
                port=port,
                user=hv.get("ansible_user") or hv.get("ansible_ssh_user"),
                key_file=hv.get("ansible_ssh_private_key_file") or hv.get("ansible_private_key_file"),
                local=_is_local(name, hv),
                known_hosts=options.get("userknownhostsfile"),
                proxy_jump=options.get("proxyjump") if options.get("proxyjump", "none").lower() != "none" else None,
                vars=_plain(dict(hv)),
            )
        )
    return hosts


INVENTORY_MAX_BYTES = 16 << 20
# How a YAML inventory starts, and a minimal INI one: what the message shows as valid
INVENTORY_EXAMPLE = ("a YAML mapping (all: {children: {trainers: {hosts: {gpu-0: {ansible_host: 10.0.0.10}}}}}) "
                     "or INI ([trainers] then one host per line: gpu-0 ansible_host=10.0.0.10)")


# A host's variables that say which machine it is and how it is reached: one host defined twice
# (in two groups, or twice in one file) with two values of one of them is two machines under one
# name, and Ansible keeps the last value in silence
_ADDRESS_VARS = ("ansible_host", "ansible_ssh_host", "ansible_port", "ansible_ssh_port", "ansible_user",
                 "ansible_ssh_user")


@contextlib.contextmanager
def _address_conflicts():
    """The (host, variable, first value, later value) that Ansible's parsers set twice for
    one host while the inventory is read: every parser (YAML, INI, script) sets a host's
    variables through InventoryData.set_variable, which overwrites; seen there, one level
    down, while the parse runs (restored after)."""
    from ansible.inventory.data import InventoryData

    original = InventoryData.set_variable
    seen: dict[tuple[str, str], Any] = {}
    conflicts: list[tuple[str, str, Any, Any]] = []

    def set_variable(self, entity, varname, value):
        if varname in _ADDRESS_VARS and entity in self.hosts and entity not in self.groups:
            key = (entity, varname)
            if key in seen and str(seen[key]) != str(value) and not any(c[:2] == key for c in conflicts):
                conflicts.append((entity, varname, seen[key], value))
            seen[key] = value
        return original(self, entity, varname, value)

    InventoryData.set_variable = set_variable
    try:
        yield conflicts
    finally:
        InventoryData.set_variable = original


def _conflict_words(conflicts: list[tuple[str, str, Any, Any]]) -> str:
    said = "; ".join(f"{host} is given {var} {first} and also {then}" for host, var, first, then in conflicts[:5])
    return (f"a host defined twice with two different addresses: {said}. Ansible would keep the last one in silence "
            "and train on one machine where two were meant: give each machine its own name (a host may be in "
            "several groups with the same variables, or with its address set once)")


@contextlib.contextmanager
def _parse_failures():
    """Ansible's own reasons for not parsing an inventory source, kept for the message
    instead of printed: it shows each plugin's failure as a warning and goes on with none."""
    from ansible.utils.display import Display

    failures: list[tuple[str, str]] = []
    original = Display.error_as_warning

    def keep(self, msg, exception, *args, **kwargs):
        plugin = re.search(r"with '([^']+)' plugin", str(msg))
        failures.append((plugin.group(1) if plugin else "", str(getattr(exception, "message", None) or exception)))

    Display.error_as_warning = keep
    try:
        yield failures
    finally:
        Display.error_as_warning = original


def _why_no_hosts(inventory: str, failures: list[tuple[str, str]]) -> str:
    """The parser's reason, for the plugin that reads this kind of file (YAML for .yml/.yaml,
    else INI), cut to a line, and what a valid inventory looks like."""
    if not failures:
        return f"inventory has no hosts: list them as {INVENTORY_EXAMPLE}"
    yaml_file = inventory.endswith((".yml", ".yaml", ".json"))
    wanted = ("yaml",) if yaml_file else ("ini",)
    chosen = [f for f in failures if f[0] in wanted] or failures
    plugin, reason = chosen[0]
    reason = re.sub(r"<class '(?:[\w.]*\.)?_?(?:AnsibleTagged|Ansible)?(\w+)'>", lambda m: m.group(1).lower(),
                    " ".join(reason.split()))
    reason = reason if len(reason) <= 300 else reason[:300] + " ..."
    return (f"Ansible cannot parse this inventory ({plugin or 'every'} plugin: {reason}); "
            f"an inventory is {INVENTORY_EXAMPLE}")


def _vault_secrets(loader, inventory: str) -> None:
    """Vault-encrypted vars decrypt with the password file Ansible would use
    (ANSIBLE_VAULT_PASSWORD_FILE, or `--vault-password-file`, which the CLI puts there)."""
    path = os.environ.get("ANSIBLE_VAULT_PASSWORD_FILE")
    if not path:
        return
    from ansible.cli import CLI
    from ansible.parsing.vault import VaultSecretsContext

    if not os.path.exists(path):
        raise UserError(f"vault password file not found: {path}", key="--vault-password-file")
    secrets = CLI.setup_vault_secrets(loader, vault_ids=[], vault_password_files=[path], initialize_context=False)
    # Ansible decrypts through one context per process, which it lets be initialized once:
    # a second inventory read in the same process adds its secrets to it instead.
    context = VaultSecretsContext.current(optional=True)
    if context is None:
        VaultSecretsContext.initialize(VaultSecretsContext(secrets))
    else:
        context.secrets[:0] = secrets


def _plain(value: Any) -> Any:
    """Ansible's own str/dict/list subclasses as plain values (as JSON would give them
    back), so a cached answer and a fresh one are the same."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str) and type(value) is not str and "Vault" not in type(value).__name__:
        return str(value)
    return value


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
