"""Two checkouts' tests never take the same fixed resource (tests/support/testbed.py): the slot table,
the slots' names, subnets and ports, and the Molecule scenarios really following them
(rendered by Molecule's own interpolation, as `molecule` reads them). A registry that died:
tests/cluster/test_testbed.py."""

from __future__ import annotations

import ipaddress
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import RESERVED_NETS, TEST_NET
from tests.support.testbed import REPO, SLOTS, Testbed, allocate_slot


class Session:
    """A process of a checkout's test session: it takes the checkout's slot and holds it until ended."""

    def __init__(self, repo: Path, state: Path):
        code = ("import sys; from pathlib import Path; from tests.support.testbed import allocate_slot\n"
                "try:\n    print(allocate_slot(Path(sys.argv[1]), Path(sys.argv[2])), flush=True)\n"
                "except RuntimeError as e:\n    print(e, flush=True)\n"
                "sys.stdin.read()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(repo), str(state)], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline().strip()
        self.slot = int(line) if line.isdigit() else line

    def end(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_each_checkout_keeps_its_slot_and_a_slot_is_taken_only_from_a_checkout_not_running_tests(tmp_path):
    state = tmp_path / "state"
    clones = [tmp_path / f"clone{i}" for i in range(SLOTS + 1)]
    for clone in clones:
        clone.mkdir()
    sessions = [Session(clone, state) for clone in clones[:SLOTS]]
    try:
        assert [s.slot for s in sessions] == list(range(SLOTS))
        again = Session(clones[1], state)  # another process of a running checkout (an xdist worker): the same
        assert again.slot == 1
        again.end()
        fifth = Session(clones[SLOTS], state)  # every slot has a session running: refused, and said why
        assert f"all {SLOTS} test slots of this machine have a test session running" in fifth.slot
        fifth.end()
        sessions[2].end()  # clone2's session ended: its slot goes to the next checkout asking
        fifth = Session(clones[SLOTS], state)
        assert fifth.slot == 2
        sessions[3].end()
        back = Session(clones[2], state)  # clone2 runs again: it gets the slot no session runs on
        assert back.slot == 3
        back.end()
        fifth.end()
        assert json.loads((state / "slots.json").read_text())[str(clones[2])] == 3
    finally:
        for s in sessions:
            if s.proc.poll() is None:
                s.end()


def test_a_table_of_idle_or_deleted_checkouts_never_blocks_a_run(tmp_path):
    """What failed a CI run: the machine's table listed four clones that still exist, none running
    tests (a machine image copied with its /var/lib). A new checkout takes the lowest slot, which
    its old holder gives up; a deleted checkout's slot is free as before."""
    state = tmp_path / "state"
    state.mkdir()
    old = [tmp_path / f"old{i}" for i in range(SLOTS)]
    for clone in old:
        clone.mkdir()
    (state / "slots.json").write_text(json.dumps({str(c): i for i, c in enumerate(old)}))
    fresh = Session(tmp_path, state)
    try:
        assert fresh.slot == 0
        table = json.loads((state / "slots.json").read_text())
        assert table == {str(tmp_path): 0, **{str(c): i for i, c in enumerate(old) if i}}
        old[2].rmdir()
        other = tmp_path / "other"
        other.mkdir()
        second = Session(other, state)  # slot 2's checkout is gone: free before an idle one is taken
        assert second.slot == 2
        second.end()
    finally:
        fresh.end()


def _allocate(args):
    repo, state = args
    return allocate_slot(Path(repo), Path(state))


def test_checkouts_asking_at_once_get_distinct_slots(tmp_path):
    """The table is read and written under a lock: processes racing for slots never share one
    (each pool process holds what it took until the pool ends)."""
    state = tmp_path / "state"
    clones = [tmp_path / f"clone{i}" for i in range(SLOTS)]
    for clone in clones:
        clone.mkdir()
    with multiprocessing.get_context("spawn").Pool(SLOTS) as pool:
        slots = pool.map(_allocate, [(str(c), str(state)) for c in clones])
    assert sorted(slots) == list(range(SLOTS))


def test_slots_share_no_name_subnet_or_port_and_stay_off_the_random_clusters():
    beds = [Testbed(s) for s in range(SLOTS)]
    scenarios = [sc for bed in beds for sc in (bed.default, bed.livedin, bed.systemd)]
    names = [h for sc in scenarios for h in sc.hosts] + [sc.network for sc in scenarios]
    assert len(set(names)) == len(names)
    nets4 = [ipaddress.ip_network(f"{sc.net4}.0/24") for sc in scenarios]
    nets6 = [ipaddress.ip_network(f"{sc.net6}::/64") for sc in scenarios]
    for nets in (nets4, nets6):
        assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])
    # inside the test range, and inside what tests/support/cluster.py never hands to a random cluster
    assert all(n.subnet_of(TEST_NET) and any(n.subnet_of(r) for r in RESERVED_NETS) for n in nets4)
    ports = [p for bed in beds for p in (bed.registry_port, bed.auth_registry_port)]
    assert len(set(ports)) == len(ports)
    roots = {bed.auth_registry_root for bed in beds}
    assert len(roots) == SLOTS
    # slot 0 is what a machine with one checkout (CI) has always had
    assert beds[0].default.hosts[0] == "ftb-mol-node0" and beds[0].livedin.network == "ftb-livedin"
    assert beds[0].systemd.hosts[0] == "ftb-sd-node0" and beds[0].systemd.net4 == "198.18.251"
    assert (beds[0].registry_port, beds[0].auth_registry_port) == (5000, 5001)


def _rendered(scenario_dir: str, env: dict[str, str]) -> dict:
    from molecule.interpolation import Interpolator, TemplateWithDefaults

    text = (REPO / "molecule" / scenario_dir / "molecule.yml").read_text()
    return yaml.safe_load(Interpolator(TemplateWithDefaults, env).interpolate(text))


@pytest.mark.parametrize("scenario_dir, which", [("default", "default"), ("lived-in", "livedin")])
def test_the_molecule_scenarios_take_the_slots_names_addresses_and_registry(tmp_path, scenario_dir, which):
    """molecule.yml as Molecule renders it for slot 2: every container, network, subnet,
    address, registry and host_vars key is slot 2's; none of slot 0's is left."""
    bed = Testbed(2)
    sc = getattr(bed, which)
    env = {"FTB_MOLECULE_IMAGE": f"{sc.gateway}:{bed.registry_port}/ftbundle/train-cpu@sha256:" + "0" * 64,
           **bed.molecule_env(sc, tmp_path / "state")}
    conf = _rendered(scenario_dir, env)
    platforms = conf["platforms"]
    assert [p["name"] for p in platforms] == sc.hosts
    assert {n["name"] for p in platforms for n in p["networks"]} == {sc.network}
    assert [n["ipv4_address"] for p in platforms for n in p["networks"]] == sc.addresses
    assert [n["ipv6_address"] for p in platforms for n in p["networks"]] == sc.addresses6
    ipam = platforms[0]["docker_networks"][0]["ipam_config"]
    assert [c["subnet"] for c in ipam] == [f"{sc.net4}.0/24", f"{sc.net6}::/64"]
    inventory = conf["provisioner"]["inventory"]
    assert sorted(inventory["host_vars"]) == sc.hosts
    assert [inventory["host_vars"][h]["ftb_address"] for h in sc.hosts] == sc.addresses
    group = inventory["group_vars"]["all"]
    assert group["nfs_server_clients"] == sc.addresses
    assert group["container_runtime_insecure_registries"][0] == f"{sc.gateway}:{bed.registry_port}"
    slot0 = Testbed(0)
    text = yaml.safe_dump(conf)
    for old in (getattr(slot0, which).net4 + ".", getattr(slot0, which).prefix + "-node", ":5000", ":5001"):
        assert old not in text, old


def test_the_systemd_scenario_takes_the_slots_names_and_addresses(tmp_path):
    bed = Testbed(2)
    sc = bed.systemd
    conf = _rendered("systemd", bed.molecule_env(sc, tmp_path / "state"))
    platforms = conf["platforms"]
    assert [p["name"] for p in platforms] == sc.hosts[:2]
    assert {n["name"] for p in platforms for n in p["networks"]} == {sc.network}
    assert [n["ipv4_address"] for p in platforms for n in p["networks"]] == sc.addresses[:2]
    assert platforms[0]["docker_networks"][0]["ipam_config"][0]["subnet"] == f"{sc.net4}.0/24"
    inventory = conf["provisioner"]["inventory"]
    assert sorted(inventory["host_vars"]) == sc.hosts[:2]
    assert inventory["group_vars"]["all"]["nfs_server_clients"] == sc.addresses[:2]
    text = yaml.safe_dump(conf)
    for old in (Testbed(0).systemd.net4 + ".", Testbed(0).systemd.prefix + "-node"):
        assert old not in text, old
