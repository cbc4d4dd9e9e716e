"""Benchmark: a model copied to every host (issue 46 item 5), `ftbundle stage` against the
tools a user would pick instead.

On N containerized hosts (3 and 16 by default) every link is capped at the same rate (tc tbf:
each host's egress on eth0, and the launcher's egress on the cluster's bridge device, as
../shared/ENVIRONMENT.md verified): on one machine uncapped container links run at memory
speed and would hide the difference between N reads of one source and one pass down a chain.
The model is SIZE MB of random bytes in 4 files on the launcher. Each tool copies it from the
launcher to every host's local disk, the destinations emptied before each:

* one copy: `rsync` to one host (the time to beat: "16 hosts in at most 2x one copy"),
* `pdcp -r` (pdsh, fan-out 32), `clush --copy` (ClusterShell, fan-out N), an `rsync` per host
  from the source, all at once (each a star: N copies through the launcher's link),
* `ftbundle stage job.yaml` (the source read once into the first host, passed down the chain),
  then again with every host holding it (the cached re-run: nothing copied),
* every host reading it from shared storage at once (`cp` from an sshfs mount of one more
  container, the storage server, whose egress is capped like every other: the kernel has no NFS,
  ../shared/ENVIRONMENT.md, and sshfs is the network filesystem it has).

Every host's copy is checked after each tool (its size; ftbundle's also by sha256 on every
host, which it does itself).

    .venv/bin/python bench/stage.py [--sizes 3,16] [--mb 1024] [--rate-mbit 400] [--runs 1]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, measure, median, table, write_section

from ftbundle.units import size_text

from tests.support.cluster import Cluster, ensure_image
from tests.support.helpers import base_job, write_job

STAGE_DIR = "/var/cache/ftbundle"
DEST = "/tmp/bench-copy"
FILES = 4


def make_model(root: Path, mb: int) -> str:
    """SIZE MB of random bytes in FILES files; the tree's sha256 (as ftbundle names it)."""
    root.mkdir(parents=True)
    each = mb * 1_000_000 // FILES
    lines = []
    for i in range(FILES):
        h = hashlib.sha256()
        with open(root / f"model-{i:05d}-of-{FILES:05d}.safetensors", "wb") as f:
            left = each
            while left:
                chunk = os.urandom(min(1 << 22, left))
                f.write(chunk)
                h.update(chunk)
                left -= len(chunk)
        lines.append(f"model-{i:05d}-of-{FILES:05d}.safetensors\0{h.hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def bridge(cluster: Cluster) -> str:
    out = subprocess.run(["docker", "network", "inspect", "-f", "{{.Id}}", cluster.network], check=True,
                         capture_output=True, text=True).stdout.strip()
    return f"br-{out[:12]}"


def cap(cluster: Cluster, hosts, rate_mbit: int) -> str:
    """Every host's egress and the launcher's (the bridge) at ``rate_mbit``; the bridge's name."""
    tbf = f"tbf rate {rate_mbit}mbit burst 256kb latency 400ms"
    for h in hosts:
        cluster.exec(h.name, f"tc qdisc replace dev eth0 root {tbf}")
    br = bridge(cluster)
    subprocess.run(["tc", "qdisc", "replace", "dev", br, "root", *tbf.split()], check=True)
    return br


def uncap(cluster: Cluster, hosts, br: str) -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", br, "root"], check=False, capture_output=True)
    for h in hosts:
        cluster.exec(h.name, "tc qdisc del dev eth0 root", check=False)


def install_pdcp(cluster: Cluster, hosts) -> None:
    """pdcp runs `pdcp -z` on every target: this machine's pdsh (the same Debian as the test
    hosts) copied into each (its readline and tinfo are in the image; the genders module is not
    loaded by the ssh rcmd)."""
    for h in hosts:
        for path in ("/usr/bin/pdcp", "/usr/bin/pdsh.bin", "/usr/lib/x86_64-linux-gnu/pdsh"):
            subprocess.run(["docker", "cp", path, f"{h.container}:{path}"], check=True, capture_output=True)


SERVER_DIR = "/export/model"
MOUNT = "/mnt/shared"


def serve(cluster: Cluster, hosts, server, src: Path) -> None:
    """The model on the storage server (the cluster's last container), mounted with sshfs on
    every host (the cluster's key copied in: the server authorizes it)."""
    # (afresh for each size: a second `docker cp` into an existing directory nests the copy in it)
    subprocess.run(["docker", "exec", server.container, "sh", "-c", f"rm -rf {SERVER_DIR} && mkdir -p /export"],
                   check=True)
    subprocess.run(["docker", "cp", str(src), f"{server.container}:{SERVER_DIR}"], check=True, capture_output=True)
    for h in hosts:
        subprocess.run(["docker", "cp", str(cluster.key_file), f"{h.container}:/root/.ssh/ftb_bench_key"], check=True)
        cluster.exec(h.name, f"mkdir -p {MOUNT} && sshfs -o StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
                             f"IdentityFile=/root/.ssh/ftb_bench_key root@{server.ip}:/export {MOUNT}")


def unserve(cluster: Cluster, hosts) -> None:
    for h in hosts:
        cluster.exec(h.name, f"fusermount3 -u {MOUNT} || umount -l {MOUNT}", check=False)


def empty(cluster: Cluster, hosts) -> None:
    for h in hosts:
        cluster.exec(h.name, f"rm -rf {STAGE_DIR} {DEST}; mkdir -p {DEST}")


def sizes_on(cluster: Cluster, hosts, where: str) -> list[int]:
    """The bytes of the files under ``where`` on each host (dot names left out)."""
    return [int(cluster.exec(h.name, f"find {where} -type f ! -name '.*' -printf '%s\\n' | "
                                     "awk '{s+=$1} END {print s+0}'").stdout.split()[0]) for h in hosts]


def ssh_opts(cluster: Cluster) -> list[str]:
    return ["-i", str(cluster.key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR"]


def run_tool(tool: str, cluster: Cluster, hosts, src: Path, job: Path):
    ips = [h.ip for h in hosts]
    opts = " ".join(ssh_opts(cluster))
    env = dict(os.environ)
    if tool == "one copy (rsync)":
        argv = ["rsync", "-a", "-e", f"ssh {opts}", f"{src}/", f"root@{ips[0]}:{DEST}/"]
    elif tool == "pdcp":
        env.update(PDSH_SSH_ARGS_APPEND=opts, PDSH_RCMD_TYPE="ssh")
        argv = ["pdcp", "-r", "-f", "32", "-l", "root", "-w", ",".join(ips), str(src), DEST]
    elif tool == "clush --copy":
        argv = [str(Path(sys.executable).parent / "clush"), "-f", str(len(ips)), "-l", "root", "-o", opts,
                "-w", ",".join(ips), "--copy", str(src), "--dest", DEST]
    elif tool == "shared storage (sshfs)":
        names = " ".join(h.container for h in hosts)
        loop = (f"for c in {names}; do docker exec $c sh -c 'cp -r {MOUNT}/model/. {DEST}/ && sync' & done; "
                "wait")
        argv = ["bash", "-c", loop]
    elif tool == "rsync per host":
        loop = f"for h in {' '.join(ips)}; do rsync -a -e 'ssh {opts}' {src}/ root@$h:{DEST}/ & done; wait"
        argv = ["bash", "-c", loop]
    else:  # ftbundle stage
        argv = [sys.executable, "-m", "ftbundle", "stage", str(job)]
    m = measure(argv, env=env)
    if m.code != 0:
        raise RuntimeError(f"{tool} failed ({m.code}): {m.stderr.decode()[-2000:]}")
    return m


def fingerprint_all(job: Path, path: str) -> tuple[float, list[int]]:
    """Every host's sha256 manifest of ``path`` at once, with the code and digest cache `check`
    uses for a node-local model (remote/probe_files.py): (seconds, bytes each host read)."""
    from ftbundle.cluster import parallel
    from ftbundle.commands.common import load_layout, open_cluster
    from ftbundle.stage import start_node

    _, layout = load_layout(str(job), None)
    with open_cluster(layout.hosts) as cluster:
        began = time.monotonic()

        def one(host):
            answer = start_node(cluster, host, {"do": "manifest", "path": path}).communicate(timeout=1800)
            done = [int(line.split()[2]) for line in answer.stderr.splitlines() if line.startswith("ftb-hashing ")]
            if answer.code != 0:
                raise RuntimeError(f"{host.name}: {answer.stdout} {answer.stderr[-500:]}")
            return done[-1] if done else 0

        read = parallel(one, list(layout.hosts))
        return time.monotonic() - began, read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="3,16")
    parser.add_argument("--mb", type=int, default=1024, help="the model's size in MB")
    parser.add_argument("--rate-mbit", type=int, default=400, help="every link's cap, Mbit/s")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--tools", help="only these (separated by ';': a tool's name may hold a comma; the one copy "
                                        "always runs)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    for tool in ("pdcp", "rsync", "tc"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (make bench installs pdsh; rsync and tc: apt-get)")
    ensure_image()
    tmp = Path(tempfile.mkdtemp(prefix="ftb-bench-stage-", dir="/tmp"))
    shared = tmp / "shared"
    shared.mkdir()
    src = tmp / "model"
    started = time.monotonic()
    digest = make_model(src, args.mb)
    tools = ["one copy (rsync)", "pdcp", "clush --copy", "rsync per host", "shared storage (sshfs)", "ftbundle stage",
             "ftbundle stage, cached"]
    if args.tools:
        tools = [t for t in tools if t == "one copy (rsync)" or t in [w.strip() for w in args.tools.split(";")]]
    rows, notes, fingerprints = [], [], []
    try:
        # one container more: the storage server (sshfs needs FUSE in the clients)
        with Cluster(max(sizes) + 1, shared_dir=shared,
                     docker_args=("--device", "/dev/fuse", "--cap-add", "SYS_ADMIN")) as cluster:
            server = cluster.hosts[-1]
            for n in sizes:
                hosts = cluster.hosts[:n]
                inventory = cluster.write_inventory(tmp / f"hosts{n}.yml")
                import yaml
                inv = yaml.safe_load(inventory.read_text())
                group = inv["all"]["children"]["trainers"]["hosts"]
                inv["all"]["children"]["trainers"]["hosts"] = {k: v for k, v in group.items()
                                                               if k in {h.name for h in hosts}}
                inventory.write_text(yaml.safe_dump(inv, sort_keys=False))
                job = write_job(tmp / f"stage{n}.yaml", base_job("stage", shared, inventory, {"command": "true"},
                                                                  stage=[str(src)], stage_dir=STAGE_DIR))
                install_pdcp(cluster, hosts)
                sshfs = "shared storage (sshfs)" in tools
                if sshfs:
                    serve(cluster, hosts, server, src)
                br = cap(cluster, [*hosts, server], args.rate_mbit)
                try:
                    times: dict[str, list[float]] = {t: [] for t in tools}
                    for run in range(args.runs):
                        for tool in tools:
                            if tool != "ftbundle stage, cached":
                                empty(cluster, hosts)
                            m = run_tool(tool, cluster, hosts, src, job)
                            where = f"{STAGE_DIR}/model-{digest[:16]}" if tool.startswith("ftbundle") else DEST
                            got = sizes_on(cluster, hosts[:1] if tool.startswith("one") else hosts, where)
                            right = all(g == args.mb * 1_000_000 // FILES * FILES for g in got)
                            if not right:
                                raise RuntimeError(f"{tool} at {n} hosts: copies of {got} bytes")
                            times[tool].append(m.wall_s)
                            print(f"{n} hosts, {tool} run {run}: {m.wall_s:.1f} s", flush=True)
                            if tool == "ftbundle stage, cached" and run == 0:
                                for when in ("first", "unchanged"):
                                    took, read = fingerprint_all(job, where)
                                    fingerprints.append([n, when, f"{took:.1f}", size_text(sum(read))])
                                    print(f"{n} hosts, fingerprint {when}: {took:.1f} s, read {sum(read)}", flush=True)
                            if tool == "ftbundle stage" and run == 0:
                                said = [ln for ln in m.stderr.decode().splitlines() if "staged " in ln]
                                notes.append(f"- {n} hosts, ftbundle said: `{said[-1].strip() if said else '?'}`")
                finally:
                    uncap(cluster, [*hosts, server], br)
                    if sshfs:
                        unserve(cluster, hosts)
                one = median(times["one copy (rsync)"])
                best_peer = min((median(times[t]) for t in ("pdcp", "clush --copy", "rsync per host",
                                                            "shared storage (sshfs)") if times.get(t)),
                                default=float("nan"))
                for tool in tools:
                    t = median(times[tool])
                    rows.append([n, tool, f"{t:.1f}", f"{t / one:.2f}x", f"{t / best_peer:.2f}x"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rate_mb = args.rate_mbit / 8
    md = "\n".join([
        "## Staging a model to every host (issue 46, item 5)", "",
        f"A {args.mb} MB model ({FILES} files of random bytes) on the launcher, copied to every host's local disk "
        f"by each tool, with every link capped at {args.rate_mbit} Mbit/s ({rate_mb:.0f} MB/s: tc tbf on each "
        "host's egress and on the bridge, the launcher's egress), the destinations emptied before each tool "
        f"(the cached row excepted). Median of {args.runs} run(s). `x one copy`: over `rsync` to one host; "
        "`x best peer`: over the fastest of pdcp, clush --copy, an rsync per host and every host reading from "
        "shared storage (sshfs). Every copy's size was "
        "checked on every host; ftbundle checks each host's copy by sha256 itself. Goal: at 16 hosts at most 2x "
        "one copy, and ahead of every peer.", "",
        table(["hosts", "tool", "s", "x one copy", "x best peer"], rows), "",
        *notes, "",
        f"The fingerprint `check` makes of a node-local model ({args.mb} MB, the staged copy), on every host at once "
        "with the check's own code and digest cache (remote/probe_files.py): the first time (each host reads its "
        "copy) and again with the copy unchanged (nothing read: each file's digest is kept by path, size, mtime "
        "and inode). `read`: the bytes all hosts read.", "",
        table(["hosts", "fingerprint", "s", "read"], fingerprints), "",
        f"The whole benchmark took {(time.monotonic() - started) / 60:.1f} min.",
    ])
    print(md)
    write_section("stage", md)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
