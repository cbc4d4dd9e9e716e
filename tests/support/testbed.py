"""What one checkout's tests take on this machine, so that two checkouts' `make test` never collide.

Most test resources are already unique per run (tests/support/cluster.py: random names, a free /24,
owner labels). What is fixed must be fixed *per checkout*: the Molecule scenarios' container
and network names, their subnets (their addresses appear in the scenarios' variables), the
local registries' ports, and Molecule's state directory (by default keyed by the project
directory's *basename*, the same for two clones named alike).

A checkout gets a **slot** (0-3) from a machine-wide table (``/var/lib/ftbundle-tests/slots.json``
under a lock): the first checkout on a machine (CI's only one) gets slot 0, whose values are
the historical ones (``ftb-mol-node0``, 198.18.250.0/24, registry port 5000); a second gets
slot 1, and so on. A slot whose checkout no longer exists, or is not running tests now (no
process holds the slot's lock), is given to the next one asking.
``FTB_TEST_SLOT`` forces a slot (how the tests of this module prove that slot 1 works).

Everything of slot *s* (``RESERVED_NETS`` in tests/support/cluster.py keeps other clusters off them):

================  ===========================  ======================================  ====================
                  default scenario             lived-in scenario                       systemd scenario
================  ===========================  ======================================  ====================
hosts             ftb-mol{s}-node0..2          ftb-liv{s}-node0..2                     ftb-sd{s}-node0..1
network           ftb-molecule{s}              ftb-livedin{s}                          ftb-systemd{s}
IPv4 /24          198.18.(250 - 2s).0          198.18.(249 - 2s).0                     198.18.(251 + s).0
IPv6 /64          fd00:f7b:0:(250 - 2s)::      fd00:f7b:0:(249 - 2s)::                 (none)
registry          :(5000 + 2s)                 :(5000 + 2s), login-only :(5001 + 2s)   (none)
================  ===========================  ======================================  ====================

(``{s}`` is empty for slot 0.)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLOTS = 4
STATE_DIR = Path(os.environ.get("FTB_TESTBED_DIR", "/var/lib/ftbundle-tests"))


@dataclass(frozen=True)
class Scenario:
    """One Molecule scenario's fixed names and addresses for a slot."""

    prefix: str  # container (and inventory host) names: PREFIX-node0..2
    network: str
    net4: str  # the first three octets: "198.18.250"
    net6: str  # the /64's first four groups: "fd00:f7b:0:250"

    @property
    def hosts(self) -> list[str]:
        return [f"{self.prefix}-node{i}" for i in range(3)]

    @property
    def addresses(self) -> list[str]:
        return [f"{self.net4}.1{i + 1}" for i in range(3)]

    @property
    def addresses6(self) -> list[str]:
        return [f"{self.net6}::1{i + 1}" for i in range(3)]

    @property
    def gateway(self) -> str:
        """The controller, as the scenario's hosts reach it."""
        return f"{self.net4}.1"

    def remove(self) -> None:
        """Its containers with their volumes (molecule's destroy keeps each host's
        /var/lib/docker volume: 1.3 GB a host, a full disk after a dozen runs) and its
        network: all that `molecule destroy` would remove, as each run's Molecule state
        directory is its own (and 7.8 s of CPU less than a `molecule destroy`)."""
        subprocess.run(["docker", "rm", "-f", "-v", *self.hosts], capture_output=True, timeout=300)
        subprocess.run(["docker", "network", "rm", self.network], capture_output=True, timeout=120)


@dataclass(frozen=True)
class Testbed:
    __test__ = False  # not a test class (pytest collects Test*)

    slot: int

    @property
    def registry_port(self) -> int:
        return 5000 + 2 * self.slot

    @property
    def auth_registry_port(self) -> int:
        return 5001 + 2 * self.slot

    @property
    def auth_registry_root(self) -> Path:
        """Where .ci/registry-auth.sh keeps the login-only registry (its password file)."""
        root = Path("/var/lib/ftbundle-registry-auth")
        return root if self.auth_registry_port == 5001 else root.with_name(f"{root.name}-{self.auth_registry_port}")

    @property
    def default(self) -> Scenario:
        return self._scenario("ftb-mol", "ftb-molecule", 250 - 2 * self.slot)

    @property
    def livedin(self) -> Scenario:
        return self._scenario("ftb-liv", "ftb-livedin", 249 - 2 * self.slot)

    @property
    def systemd(self) -> Scenario:
        return self._scenario("ftb-sd", "ftb-systemd", 251 + self.slot)

    def _scenario(self, prefix: str, network: str, octet: int) -> Scenario:
        tag = str(self.slot) if self.slot else ""
        return Scenario(f"{prefix}{tag}", f"{network}{tag}", f"198.18.{octet}", f"fd00:f7b:0:{octet}")

    def molecule_env(self, scenario: Scenario, state_dir: Path) -> dict[str, str]:
        """The variables molecule/*/molecule.yml reads (with slot 0's values as defaults),
        and a state directory of this run's own."""
        return {
            "FTB_MOL_PREFIX": scenario.prefix,
            "FTB_MOL_NETWORK": scenario.network,
            "FTB_MOL_NET4": scenario.net4,
            "FTB_MOL_NET6": scenario.net6,
            "FTB_REGISTRY_PORT": str(self.registry_port),
            "FTB_REGISTRY_AUTH_PORT": str(self.auth_registry_port),
            "MOLECULE_EPHEMERAL_DIRECTORY": str(state_dir),
        }

    def script_env(self) -> dict[str, str]:
        """For .ci/registry.sh and .ci/registry-auth.sh."""
        return {"FTB_REGISTRY_PORT": str(self.registry_port), "FTB_REGISTRY_AUTH_PORT": str(self.auth_registry_port)}


_HELD: dict[tuple[str, int], object] = {}  # (state dir, slot) -> its lock file, open (held) for the process's life


def _slot_lock(state_dir: Path, slot: int):
    return open(state_dir / f"slot{slot}.lock", "a")


def _in_use(state_dir: Path, slot: int) -> bool:
    """Some process (of any checkout) holds slot's lock: a test session is running on it."""
    with _slot_lock(state_dir, slot) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def allocate_slot(repo: Path, state_dir: Path = STATE_DIR) -> int:
    """This checkout's slot: the one it holds, else the lowest one no checkout holds, else
    the lowest one whose checkout is not running tests now (it is taken from that checkout,
    whose next session gets another slot). A checkout that no longer exists frees its slot.
    The process holds the slot's lock (shared, with the checkout's other processes: xdist's
    workers) until it exits: that is what "running tests now" means, so a table left by
    clones that are idle, or by a machine image copied with its /var/lib, never blocks a run.
    Raises RuntimeError only when every slot has a test session running on it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    table_path = state_dir / "slots.json"
    with open(state_dir / "slots.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            table = {k: int(v) for k, v in json.loads(table_path.read_text()).items()}
        key = str(repo.resolve())
        table = {path: slot for path, slot in table.items() if path == key or Path(path).is_dir()}
        if key not in table:
            # not running tests now; of those, first one no checkout holds (a checkout keeps its names)
            idle = sorted((s in table.values(), s) for s in range(SLOTS) if not _in_use(state_dir, s))
            if not idle:
                raise RuntimeError(f"all {SLOTS} test slots of this machine have a test session running on them: "
                                   f"{table} (in {table_path}); wait for one to end")
            slot = idle[0][1]
            table = {path: s for path, s in table.items() if s != slot}
            table[key] = slot
        if (str(state_dir), table[key]) not in _HELD:
            held = _slot_lock(state_dir, table[key])
            fcntl.flock(held, fcntl.LOCK_SH)
            _HELD[(str(state_dir), table[key])] = held
        tmp = table_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        tmp.replace(table_path)
        return table[key]


@functools.cache
def checkout_testbed() -> Testbed:
    """This checkout's testbed (FTB_TEST_SLOT overrides the table)."""
    forced = os.environ.get("FTB_TEST_SLOT")
    if forced is not None:
        slot = int(forced)
        if not 0 <= slot < SLOTS:
            raise ValueError(f"FTB_TEST_SLOT={forced}: must be 0-{SLOTS - 1}")
        return Testbed(slot)
    return Testbed(allocate_slot(REPO))


def registry_answers(port: int, timeout: float = 5) -> bool:
    """The local registry on port answers its API root (200, or 401 for the login-only one)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=timeout) as r:
            return r.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False


def ensure_registry(port: int, script: str = ".ci/registry.sh", **env: str) -> str | None:
    """Before each test that needs it: the registry on port answers, else it is started again
    by its script (which pushes the training image again: the same digest, its blobs are
    still in the registry's storage). ``env`` is the script's, naming the same port
    (``Testbed.script_env()``). Returns the script's last line when it ran, else None."""
    if registry_answers(port):
        return None
    proc = subprocess.run(["bash", script], cwd=REPO, capture_output=True, text=True, timeout=1200, check=False,
                          env={**os.environ, **env})
    if proc.returncode != 0 or not registry_answers(port):
        raise RuntimeError(f"{script} could not start the registry on :{port} again:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]
