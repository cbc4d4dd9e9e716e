"""Benchmark: how long site.yml takes, first run (fresh hosts) and second run (nothing to
do), on 3 and 8 containerized hosts, with Ansible's defaults and with what this
repository's ansible.cfg turns on.

"defaults": no pipelining, 5 forks, facts gathered in every play, no fact cache.
"ansible.cfg": pipelining (one SSH round trip per task instead of several), forks 16 (all
hosts at once), `gathering = smart` with a jsonfile fact cache (facts gathered once, not
once per play), SSH ControlPersist. Every run is on fresh hosts from tests/support/cluster.py
(real sshd, strict host keys), over SSH from this machine.

The test hosts cannot run a nested Docker engine (tests/support/cluster.py gives them no
SYS_ADMIN), so the `docker` and `image` phases are skipped: their time is the engine's
and the image pull's, which no Ansible setting changes. Everything else runs for real:
preflight, the NFS export, the SSH mesh, the firewall, fstab, the NCCL env, verify.

    .venv/bin/python bench/provision.py [--nodes 3 8]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import Cluster, ensure_image  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from common import measure, table, write_section  # noqa: E402

PLAYBOOK = [str(Path(sys.executable).parent / "ansible-playbook"), "site.yml", "--skip-tags", "docker,image"]
CONFIGS = {
    # Ansible's own defaults, overriding ansible.cfg
    "defaults": {"ANSIBLE_PIPELINING": "False", "ANSIBLE_FORKS": "5", "ANSIBLE_GATHERING": "implicit",
                 "ANSIBLE_CACHE_PLUGIN": "memory"},
    # what ansible.cfg sets (the fact cache goes to a fresh directory per cluster)
    "ansible.cfg": {},
}


def inventory(cluster: Cluster, path: Path, keys: Path) -> Path:
    """The cluster as site.yml's inventory: every host a trainer, node0 also the NFS server."""
    trainers = {}
    for h in cluster.hosts:
        trainers[h.name] = {"ansible_host": h.ip, "ftb_address": h.ip}
    common = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(cluster.key_file),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={cluster.known_hosts} -o StrictHostKeyChecking=yes",
        "ansible_python_interpreter": "/usr/bin/python3",
        "ftb_image": "198.18.0.1:5000/ftbundle/none@sha256:" + "0" * 64,  # image phase skipped
        "ftb_shared_dir": str(cluster.shared_dir),
        "ftb_training_user": "root",
        "nfs_server_manage_service": False,
        "nfs_client_mount": False,
        "ssh_mesh_key_dir": str(keys),
    }
    inv = {"all": {"vars": common, "children": {
        "trainers": {"hosts": trainers},
        "nfs_server": {"hosts": {cluster.hosts[0].name: {}}}}}}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def recap(output: str) -> tuple[int, int]:
    """(changed, failed) summed over the PLAY RECAP."""
    tail = output.split("PLAY RECAP", 1)[-1]
    changed = sum(int(n) for n in re.findall(r"changed=(\d+)", tail))
    failed = sum(int(n) for n in re.findall(r"failed=(\d+)", tail)) + sum(
        int(n) for n in re.findall(r"unreachable=(\d+)", tail))
    return changed, failed


def one(nodes: int, config: str, image: str) -> tuple[float, float, int]:
    """site.yml twice on a fresh cluster: (first s, second s, changed in the second)."""
    work = Path(tempfile.mkdtemp(prefix="ftb-bench-provision-"))
    try:
        with Cluster(nodes, name_prefix="ftb-bprov", shared_dir=work / "shared", image=image) as cluster:
            inv = inventory(cluster, work / "hosts.yml", work / "ssh")
            env = dict(os.environ, ANSIBLE_FORCE_COLOR="0", ANSIBLE_CACHE_PLUGIN_CONNECTION=str(work / "facts"),
                       **CONFIGS[config])
            argv = [*PLAYBOOK, "-i", str(inv)]
            times, second_changed = [], 0
            for attempt in (1, 2):
                m = measure(argv, env=env)
                out = m.stdout.decode(errors="replace")
                changed, failed = recap(out)
                if m.code != 0 or failed:
                    raise SystemExit(f"site.yml failed ({config}, {nodes} hosts, run {attempt}):\n{out[-4000:]}"
                                     f"\n{m.stderr.decode(errors='replace')[-2000:]}")
                times.append(m.wall_s)
                second_changed = changed
            return times[0], times[1], second_changed
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[3, 8])
    args = ap.parse_args()
    image = ensure_image()
    os.chdir(REPO)  # ansible.cfg and site.yml
    rows, results = [], {}
    for nodes in args.nodes:
        for config in CONFIGS:
            first, second, changed = one(nodes, config, image)
            results[nodes, config] = (first, second)
            rows.append([nodes, config, f"{first:.0f} s", f"{second:.0f} s", changed])
            print(f"{nodes} hosts, {config}: first {first:.1f} s, second {second:.1f} s (changed={changed})",
                  flush=True)
    ratios = [f"{nodes} hosts: first run {results[nodes, 'defaults'][0] / results[nodes, 'ansible.cfg'][0]:.1f}x, "
              f"second run {results[nodes, 'defaults'][1] / results[nodes, 'ansible.cfg'][1]:.1f}x faster with ansible.cfg"
              for nodes in args.nodes]
    md = "\n".join([
        "## Provisioning: site.yml, first and second run", "",
        "`ansible-playbook site.yml` over SSH on fresh containerized hosts (tests/support/cluster.py), node0 also the NFS "
        "server; the `docker` and `image` phases skipped (the test hosts cannot run a nested engine; their time is "
        "the engine's and the pull's). \"defaults\": no pipelining, 5 forks, facts gathered per play, no cache. "
        "\"ansible.cfg\": pipelining, forks 16, `gathering = smart` with a jsonfile fact cache, SSH ControlPersist. "
        "The second run changes nothing (its `changed` column).", "",
        table(["hosts", "settings", "first run", "second run", "changed (2nd)"], rows), "",
        "; ".join(ratios) + ".",
    ])
    write_section("provision", md)


if __name__ == "__main__":
    main()
