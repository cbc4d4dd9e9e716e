"""Rules: pure functions from the hosts' facts and the layout to findings.

Each rule follows the StackHPC pattern: one value per host, hosts grouped by value, and one
failure, showing the grouping, when the value is wrong or there is more than one group. The
odd host out is then plain to see. Nothing here does I/O; :func:`evaluate` runs them all.
"""

from __future__ import annotations

import posixpath
import re

from .. import gpu_health as H
from ..facts import ClusterFacts, HostFacts, bf16_capable, describe_gpus
from ..facts import visible as visible_under
from ..gpu_health import XID_WINDOW_S
from ..hostlist import fold, fold_numbers
from ..layout import Layout
from ..paths import is_under
from ..trackers import PACKAGES as TRACKERS
from ..remote.evidence import waits_in
from .finding import Check, describe_groups, group_by_value, per_hosts
from .bytes_rules import check_datasets, check_model_bytes  # noqa: F401 (re-exported: the rules' names)
from .checkpoint_rules import check_checkpoint_space  # noqa: F401 (re-exported: the rules' names)
from .storage_rules import check_output_dir, check_storage  # noqa: F401 (re-exported: the rules' names)
from .tracker_rules import check_trackers  # noqa: F401 (re-exported: the rules' names)

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _grouped(name: str, values: dict[str, str], failure: str | None = None) -> Check:
    """A check that fails with `failure` when the hosts do not all agree."""
    groups = group_by_value(values)
    return Check(name, groups, failure if failure and len(groups) > 1 else None)


def check_ssh(facts: list[HostFacts]) -> Check:
    values = {f.host: ("unreachable" if f.error else "reachable") for f in facts}
    check = Check("ssh", group_by_value(values))
    bad = [f for f in facts if f.error]
    if bad:
        check.failure = "hosts not reachable"
        by_reason: dict[str, list[HostFacts]] = {}
        for f in bad:  # "cannot SSH to ADDRESS: REASON": hosts with the same reason make one line
            by_reason.setdefault(re.sub(r"^cannot SSH to \S+( through \S+)?: ", "", f.error), []).append(f)
        check.details = [f"{fs[0].host} (node rank {fs[0].rank}): {fs[0].error}" if len(fs) == 1 else
                         f"{fold(f.host for f in fs)} (node ranks {fold_numbers(f.rank for f in fs)}): cannot SSH: {reason}"
                         for reason, fs in by_reason.items()]
    return check


def check_hostnames(facts: list[HostFacts]) -> Check:
    """Two inventory entries that are one machine (two addresses of one host) would run
    two nodes' ranks on the same GPUs."""
    values = {f.host: f.hostname for f in facts}
    groups = group_by_value(values)
    check = Check("hostname", [(f"{len(groups)} distinct", list(values))])
    twins = [(name, hosts) for name, hosts in groups if len(hosts) > 1]
    if twins:
        check.failure = "hosts are the same machine"
        check.details = [f"{fold(hosts)} all have hostname {name}" for name, hosts in twins]
    return check


def check_system(facts: list[HostFacts]) -> Check:
    return _grouped("system", {f.host: f.kernel for f in facts})  # shown, never fails


TRACKER_PACKAGES = {d for dists in TRACKERS.values() for d in dists}


def _versions(f: HostFacts) -> str:
    """The packages asked for, as found; the trackers' apart (check/tracker_rules.py shows and
    judges them: hosts need not agree on a tracker only rank 0 uses)."""
    return " ".join(f"{k}={v}" for k, v in (f.versions or {}).items() if k not in TRACKER_PACKAGES)


def check_runtime(facts: list[HostFacts], docker: bool, mode: str = "script", python: str = "python3") -> Check:
    """Same interpreter and packages (host runtime), or the same image, by digest and ID,
    on every host (docker), its packages shown beside it; and what the job needs there:
    torch for every torchrun job, LlamaFactory for a LlamaFactory job."""
    name = "image" if docker else "versions"
    values = {}
    for f in facts:
        if f.runtime_error:
            values[f.host] = f"ERROR {f.runtime_error}"
        elif docker:
            values[f.host] = f"{f.image} (ID {f.image_id})" + (f" {_versions(f)}" if f.versions else "")
        else:
            values[f.host] = _versions(f)
    check = _grouped(name, values, f"{name} differ")
    broken = [f for f in facts if f.runtime_error]
    if broken:
        check.failure = f"{name} unavailable"
        check.details = [f"{f.host}: {f.runtime_error}" for f in broken]
        return check
    needed = {"script": ("torch",), "llamafactory": ("torch", "llamafactory")}.get(mode, ())
    where = "the image" if docker else python
    how = ("build the training image with them (docs/quickstart-servers.md#the-training-image), record it with "
           "site.yml (ftb_image) or name it in runtime.image" if docker else
           f"install them for {python} on every host, or point the job's runtime.python at an interpreter that has them")
    missing = [(f.host, pkg, lambda hosts, pkg=pkg: f"{pkg} is not installed in {where} on {hosts}")
               for f in facts for pkg in needed if (f.versions or {}).get(pkg) == "absent"]
    if missing:
        check.failure = "packages missing"
        check.details = per_hosts(missing) + [f"(a {mode} job needs {' and '.join(needed)}: {how})"]
    if mode == "llamafactory":
        check.warnings += judged_by_other_version(facts)
    return check


def judged_by_other_version(facts: list[HostFacts]) -> list[str]:
    """A warning where the hosts' LlamaFactory is not the one whose declarations judged the
    config before anything started (ftbundle/lfargs/declared.py): a key it added, removed or
    changed since may have been judged wrongly (the hosts' own is what the ranks use)."""
    from ..lfargs import schema

    judged = schema()["llamafactory"]
    other = {f.host: v for f in facts if (v := (f.versions or {}).get("llamafactory")) not in (None, "absent", judged)}
    if not other:
        return []
    groups = "; ".join(f"{v} on {fold(hosts)}" for v, hosts in group_by_value(other))
    return [f"LlamaFactory {groups}: the config was judged by LlamaFactory {judged}'s declarations before the start "
            f"(a key added or changed since may be judged wrongly); `python -m ftbundle.lfargs --write` with the "
            "hosts' LlamaFactory installed here judges by theirs"]


def check_training(facts: list[HostFacts], layout: Layout) -> Check | None:
    """What the job's settings ask of the hosts, before every rank fails on it: half
    precision needs GPUs that have it (bf16: compute capability 8.0+), a CPU job no more
    ranks than a host has cores, and the files the job names (its script, a base model
    given as a path) on every host."""
    job = layout.job
    check = Check("training", [])
    config = layout.lf_config or {}
    source = job.train.llamafactory_source or "the LlamaFactory config"
    for key in ("bf16", "pure_bf16", "fp16"):
        if config.get(key) is not True:
            continue
        without = [f.host for f in facts if not f.visible_gpus(layout.visible_env(f.host))]
        if without or job.gpus_per_node == 0:
            check.details.append(f"{key}: true in {source}, but {fold(without) if without else 'the job'} "
                                 f"{'has no GPU for the job' if without else 'is a CPU job (gpus_per_node: 0)'}: "
                                 f"set {key}: false (a CPU job: use_cpu: true)")
        elif key != "fp16":
            old = [f.host for f in facts if not bf16_capable(f.visible_gpus(layout.visible_env(f.host)))]
            if old:
                check.details.append(f"{key}: true in {source}, but the GPUs of {fold(old)} cannot do bf16 "
                                     "(compute capability below 8.0: before Ampere): use fp16: true instead")
    cpu_job = job.gpus_per_node == 0 or not any(f.gpus for f in facts)
    if cpu_job:
        over = [(f.host, (n, f.cpus), lambda hosts, n=n, c=f.cpus: (
                    f"{n} CPU rank(s) on {hosts}, which {'has' if ',' not in hosts and '[' not in hosts else 'have'} "
                    f"{c} core(s): each rank would get a fraction of one; set nproc_per_node (or ftb_nproc_per_node) "
                    f"to at most {c}"))
                for f in facts if f.cpus and (n := layout.host_nproc(f.host, None)) and n > f.cpus]
        check.details += per_hosts(over)
    for key, path in sorted({k: p for f in facts for k, p in job_paths(layout).items()}.items()):
        lacking = [(f.host, f.paths[key], lambda hosts, why=f.paths[key]: f"{path} on {hosts}: {why}")
                   for f in facts if f.paths.get(key)]
        if lacking:
            check.details += [f"{key} {line}" for line in per_hosts(lacking)]
    if not check.details:
        return None
    check.failure = "the job does not fit the hosts"
    check.groups = [("does not fit", [f.host for f in facts])]
    return check


def job_paths(layout: Layout) -> dict[str, str]:
    """The files the job names that must be on every host before anything starts: the
    script (script mode), a base model given as a path and a DeepSpeed JSON that is not
    beside the config on this machine (LlamaFactory), relative to the
    workdir as the ranks will read them. With the docker runtime only what the container
    sees at the same path (the shared directory, the workdir) can be looked at from the host."""
    job = layout.job
    named: dict[str, str] = {}
    if job.train.mode == "script" and job.train.script:
        named["train.script"] = job.train.script
    model = (layout.lf_config or {}).get("model_name_or_path")
    if isinstance(model, str) and model.startswith(("/", "./", "../")):
        named["model_name_or_path"] = model
    ds = (layout.lf_config or {}).get("deepspeed")
    if job.train.deepspeed_json is None and isinstance(ds, str) and ds.strip():
        named["deepspeed"] = ds  # (not beside the config here: the ranks read it on the hosts)
    found = {}
    for key, path in named.items():
        path = posixpath.normpath(posixpath.join(layout.workdir, path))
        if host_sees(layout, path):  # (else in the image, perhaps: the container's own files are not the host's)
            found[key] = path
    return found


def host_sees(layout: Layout, path: str) -> bool:
    """Whether the host's ``path`` is the one the ranks use: always with the host runtime; with
    the docker runtime only under what is mounted at the same path (shared_dir, workdir)."""
    return not layout.docker or any(is_under(path, d) for d in (layout.shared_dir, layout.workdir))


def check_gpus(facts: list[HostFacts], layout: Layout, nproc_per_node: int | None) -> Check:
    """The same kind of GPUs everywhere (their counts may differ: each host runs its own
    number of ranks), as many visible to the job on each host as its ranks (``auto``: one
    rank per GPU it sees, > 0), nvidia-smi answering, and no other process on them."""
    job = layout.job
    values = {f.host: (f"ERROR {f.gpu_error}" if f.gpu_error else describe_gpus(f.gpus)) for f in facts}
    check = Check("gpus", group_by_value(values))
    errors = [f for f in facts if f.gpu_error]
    kinds = {frozenset(g.kind for g in f.gpus) for f in facts if not f.gpu_error}
    if errors:
        check.failure = "nvidia-smi failed"
        check.details = [f"{f.host}: {'GPU driver hung: ' if f.gpu_hung else 'nvidia-smi failed: '}{f.gpu_error}"
                         for f in errors]
    elif len(kinds) > 1:
        check.failure = "GPUs differ"
    visible = {f.host: f.visible_gpus(layout.visible_env(f.host)) for f in facts if not f.gpu_error}
    counts = {h: len(v) for h, v in visible.items()}
    limited = {f.host: visible[f.host] != f.gpus for f in facts if not f.gpu_error}
    # each host's ranks: its ftb_nproc_per_node, else the job's (as given, or auto: what it sees)
    ranks = {h: layout.host_nproc(h, counts[h] or None) if job.nproc_per_node == "auto" or h in layout.host_nprocs
             else nproc_per_node for h in counts}

    def said(host: str) -> str:
        return (f"ftb_nproc_per_node of {host} is {ranks[host]}" if host in layout.host_nprocs
                else f"nproc_per_node is {ranks[host]}")

    def seen(host: str) -> str:
        why = " (ftb_gpus)" if host in layout.host_gpus else " (CUDA_VISIBLE_DEVICES)"
        return f"{counts[host]} GPU(s)" + (" visible" + why if limited[host] else "")

    fit = []
    unknown = [h for h, r in ranks.items() if r is None]
    if unknown and len(unknown) == len(ranks) and not any(counts.values()):
        fit.append("nproc_per_node is auto but no host has a GPU; set the number of ranks per host")
    else:
        fit += [f"nproc_per_node is auto but {h} has no GPU visible to the job; set ftb_nproc_per_node for it "
                "in the inventory" for h in unknown]
    for f in facts:  # an ftb_gpus entry that names no GPU of its host: CUDA ends the list there
        wanted = layout.host_gpus.get(f.host)
        if wanted and job.gpus_per_node != 0 and not f.gpu_error:
            found = visible_under(f.gpus, ",".join(wanted))
            if len(found) < len(wanted):
                has = ("no GPU" if not f.gpus else "GPUs " + ",".join(g.index or str(i) for i, g in enumerate(f.gpus)))
                fit.append(f"ftb_gpus of {f.host} is {','.join(wanted)} but {f.host} has {has}: "
                           f"'{wanted[len(found)]}' names no GPU there (its ranks would see "
                           f"{len(found)} of the {len(wanted)})")
    known = {h: r for h, r in ranks.items() if r is not None}
    if any(f.gpus for f in facts):
        for host, want in known.items():
            if counts[host] < want:
                fit.append(f"{said(host)} but {host} has {seen(host)}")
                if counts[host] and host not in layout.host_nprocs:  # an 8-GPU beside a 4-GPU host: say how
                    check.notes.append(f"{host} can run {counts[host]} rank(s): set ftb_nproc_per_node: "
                                       f"{counts[host]} for it in the inventory, or nproc_per_node: auto")
            elif counts[host] > want and not limited[host]:
                check.notes.append(f"{host} has {counts[host]} GPUs; {want} rank(s) use the first {want}")
    elif known:
        check.notes.append("no GPUs: " + (f"{next(iter(known.values()))} CPU rank(s) per host"
                                          if len(set(known.values())) == 1
                                          else "CPU ranks " + ", ".join(f"{r} on {h}" for h, r in known.items())))
    if len(set(ranks.values())) > 1 and not unknown:
        check.notes.append("ranks per host differ: " + describe_groups(group_by_value(
            {h: f"{r} rank(s)" for h, r in ranks.items()})) + f"; world size {sum(ranks.values())}")
    if isinstance(job.gpus_per_node, int) and job.gpus_per_node > 0:
        for host, count in counts.items():
            if count < job.gpus_per_node:
                fit.append(f"gpus_per_node is {job.gpus_per_node} but {host} has {seen(host)}")
    elif job.gpus_per_node == 0 and any(counts.values()):
        check.notes.append("gpus_per_node is 0: a CPU job, its ranks see no GPU (CUDA_VISIBLE_DEVICES empty)")
    if nproc_per_node is not None or not unknown:  # what `ftbundle export` would ask a scheduler for
        from ..export import gpus_per_node

        asks = {h: gpus_per_node(job, r if r is not None else nproc_per_node) for h, r in ranks.items()} \
            or {"": gpus_per_node(job, nproc_per_node)}
        # said only where an export would differ from this run: GPUs requested for hosts where the
        # run finds none and trains on CPUs (elsewhere it is the run's own count: nothing to say)
        cpu_hosts = [h for h in counts if not counts[h] and asks.get(h, next(iter(asks.values()))) > 0]
        if cpu_hosts:
            asked = (f"{next(iter(asks.values()))} GPU(s) per node" if len(set(asks.values())) == 1
                     else "GPUs per node " + ", ".join(f"{n} on {h}" for h, n in asks.items()))
            check.notes.append(f"this run trains on CPUs on {fold(cpu_hosts)} (no GPUs there), while an export of "
                               f"this job requests {asked} (gpus_per_node: {job.gpus_per_node}); set gpus_per_node: 0 "
                               "to export a CPU job (`ftbundle export --dry-run` shows cores and memory)")
    if fit:
        if check.failure == "GPUs differ":
            check.details.append(f"GPUs differ: {describe_groups(check.groups)}")
        check.failure = check.failure or ("GPUs do not fit " + (
            "nproc_per_node" if any("nproc_per_node" in line for line in fit) else "gpus_per_node"))
        check.details += fit
    for f in facts:
        uuids = {g.uuid for g in f.visible_gpus(layout.visible_env(f.host))}
        busy = [a for a in f.compute_apps if a.gpu_uuid in uuids or not uuids]
        if busy:
            check.warnings.append(f"{f.host}: GPUs in use by " + ", ".join(
                f"pid {a.pid} ({a.name}, {a.used_memory_mib if a.used_memory_mib is not None else '?'} MiB)"
                for a in busy) + " (a previous run still alive? another job?)")
        elif any((g.memory_used_mib or 0) > 1024 for g in f.visible_gpus(layout.visible_env(f.host))):
            used = ", ".join(f"GPU {g.index}: {g.memory_used_mib} MiB" for g in f.visible_gpus(layout.visible_env(f.host))
                             if (g.memory_used_mib or 0) > 1024)
            check.warnings.append(f"{f.host}: GPU memory already in use ({used}) by no process nvidia-smi can "
                                  "see (another container?)")
    return check


def check_health(facts: list[HostFacts], mode: str, window_s: float = XID_WINDOW_S) -> Check | None:
    """GPU health: hosts grouped by what is wrong with their GPUs (the findings: ftbundle.gpu_health). ``mode``
    is the job's ``health``: refuse (fatal findings fail the check), warn (everything is a
    warning), off (None: not asked). Hosts whose health could not be read are warned about;
    a kernel log that could not be read is a note (the rest of the check still stands)."""
    asked = [f for f in facts if f.health_asked]
    if mode == "off" or not asked:
        return None
    per_host = {f.host: H.findings(f.host, f.gpu_health, f.xids, window_s) for f in asked}
    values = {}
    for f in asked:
        found = per_host[f.host]
        if found:
            values[f.host] = ("unfit: " if any(x.fatal for x in found) and mode == "refuse" else "") + ", ".join(
                dict.fromkeys(x.kind for x in found))
        elif f.health_error:
            values[f.host] = "unknown"
        elif f.gpu_health:
            values[f.host] = f"{len(f.gpu_health)} GPU(s) healthy"
        else:
            values[f.host] = "no GPUs"
    check = Check("gpu_health", group_by_value(values), label="gpu health")
    everything = [x for f in asked for x in per_host[f.host]]
    fatal = [x for x in everything if x.fatal]
    if mode == "refuse" and fatal:
        check.failure = "GPUs unfit to run (health: refuse)"
        check.details = H.fold_findings(fatal)
        if any(x.kind.startswith("Xid") for x in fatal):
            check.notes.append("after a GPU reset or repair, a past Xid still counts for "
                               f"{window_s / 3600:g} h: `health: warn` lets a run start")
        everything = [x for x in everything if not x.fatal]
    check.warnings += H.fold_findings(everything)
    check.warnings += per_hosts([(f.host, f.health_error, lambda hosts, e=f.health_error: (
        f"GPU health not read on {hosts}: {e}")) for f in asked if f.health_error])
    check.notes += per_hosts([(f.host, f.kernel_log_error, lambda hosts, e=f.kernel_log_error: (
        f"Xid events not read on {hosts}: {e}")) for f in asked if f.kernel_log_error])
    return check


def check_storage_answers(facts: list[HostFacts]) -> Check | None:
    """A stat under shared storage not answered: hung storage on evidence only (remote/evidence.py), else starved."""
    asked = [(f, name, s) for f in facts for name, s in f.storage.items()]
    starved = [x for x in asked if x[2].slow and x[2].slow.verdict == "starved"]
    busy = [x for x in starved if x[2].not_answering_s is not None]
    hung = [x for x in asked if x[2].not_answering_s is not None and x not in busy]
    if not hung and not starved:
        return None
    values = {f.host: "starved" if any(x[0] is f for x in busy) else "not answering" if any(x[0] is f for x in hung)
              else "answers" for f in facts}
    check = Check("storage", group_by_value(values), label="shared storage")
    # hosts share a line when what it says of them is alike: not the seconds waited nor the
    # load, which differ on every host; the line gives its hosts' longest wait
    keyed = [(f.host, (s.path, name, s.slow and waits_in(s.slow.state, s.slow.wchan)), s.not_answering_s)
             for f, name, s in hung]
    longest: dict[tuple, float] = {}
    for _, key, waited in keyed:
        longest[key] = max(waited, longest.get(key, 0.0))
    check.details = per_hosts([(host, key, lambda hosts, key=key: (
        f"shared storage {key[0]} ({key[1]}) on {hosts} not answering for {longest[key]:.0f}s: a stat under it got "
        f"no answer{f', its process {key[2]} while the host ran' if key[2] else ''} "
        "(a hung network filesystem: its server down, or the network to it cut?); every process that touches it "
        "waits until it answers")) for host, key, _ in keyed])
    check.details += _starved(busy, "was not run in")
    check.warnings = _starved([x for x in starved if x not in busy], "waited to be run for")
    check.failure = "shared storage not answering" if hung else "hosts too busy to check it" if busy else None
    return check


def _starved(items: list, what: str) -> list[str]:
    """`host node3 is starved: a stat under /shared ... for 9s (its process runnable (R), not run; load 140)`."""
    out = []
    for path, name in dict.fromkeys((s.path, name) for _, name, s in items):
        group = [(f.host, s.slow, s.not_answering_s) for f, n, s in items if (s.path, n) == (path, name)]
        seen = ", ".join(sorted({waits_in(slow.state, slow.wchan) for _, slow, _ in group}))
        load = max((slow.load for _, slow, _ in group if slow.load is not None), default=None)
        who = f"host {group[0][0]} is" if len(group) == 1 else f"hosts {fold(h for h, _, _ in group)} are"
        waited = max(gave_up or slow.waited_s for _, slow, gave_up in group)
        out.append(f"{who} starved: a stat under {path} ({name}) {what} {waited:.0f}s (its process {seen}"
                   f"{f'; load {load:g}' if load is not None else ''}): its CPUs are taken, not a hung filesystem")
    return out


def check_dirs(facts: list[HostFacts], layout: Layout) -> Check:
    """workdir and shared_dir on every host. Rank 0 creates a missing shared_dir; a host
    that does not see it then has a parent that is not the same storage, and is told so."""
    workdir, shared_dir = layout.workdir, layout.shared_dir
    label = f"workdir {workdir}" + (f", shared_dir {shared_dir}" if shared_dir != workdir else "")
    check = Check("dirs", [("present", [f.host for f in facts])], label=label)
    parent = posixpath.dirname(shared_dir.rstrip("/")) or "/"
    created_on = next((f.host for f in facts if f.shared.created), None)
    if created_on:
        check.notes.append(f"created {shared_dir} on {created_on} (rank 0)")
    problems = []
    for f in facts:
        if f.shared.not_answering_s is not None:
            continue  # (check_storage_answers names it)
        if not f.workdir_ok and workdir != shared_dir:
            problems.append((f.host, "workdir", lambda hosts: f"workdir {workdir} does not exist on {hosts}"))
        s = f.shared
        if s.exists:
            continue
        if not s.parent_exists:
            problems.append((f.host, "parent", lambda hosts: (
                f"{parent}, the parent of shared_dir {shared_dir}, does not exist on "
                f"{hosts} (shared storage not mounted there?)")))
        elif created_on and created_on != f.host:
            problems.append((f.host, "unseen", lambda hosts: (
                f"shared_dir {shared_dir} was just created on {created_on} (rank 0), but "
                f"{hosts} does not see it: {parent} on {hosts} is not the same storage as on {created_on}")))
        else:
            problems.append((f.host, ("create", s.error), lambda hosts, error=s.error: (
                f"shared_dir {shared_dir} on {hosts}: {error}: set shared_dir (job) or ftb_shared_dir (inventory) "
                "to a directory" if error and "not a directory" in error else
                f"shared_dir {shared_dir} does not exist on {hosts} and could not be created "
                "there" + (f" ({error})" if error else ""))))
    check.details = per_hosts(problems)
    if check.details:
        check.failure = "directories missing"
        bad = {f.host for f in facts if not f.shared.exists or (not f.workdir_ok and workdir != shared_dir)}
        check.groups = group_by_value({f.host: "missing" if f.host in bad else "present" for f in facts})
    if any(f.shared.not_answering_s is not None for f in facts):
        seen = {host: value for value, hosts in check.groups for host in hosts}
        check.groups = group_by_value({f.host: "not answering" if f.shared.not_answering_s is not None
                                       else seen.get(f.host, "present") for f in facts})
    return check


def _ifname_matches(spec: str, dev: str) -> bool:
    """NCCL_SOCKET_IFNAME syntax: comma-separated prefixes, `=` exact, `^` excludes."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    hit = any(dev == n if exact else dev.startswith(n) for n in names)
    return not hit if exclude else hit


def check_route(facts: list[HostFacts], layout: Layout) -> Check:
    """The interface each host reaches rank 0 through, and whether the socket interface
    named for NCCL/gloo exists there (gloo stops with "Unable to find address" if not)."""
    values = {}
    for f in facts:
        r = f.route
        if r is None or r.dev is None:
            values[f.host] = f"ERROR {r.error if r else 'no route'}"
        elif r.local:
            values[f.host] = f"{r.dev} (rank 0 itself)"
        else:
            values[f.host] = r.dev
    check = Check("route", group_by_value(values), label=f"route to {layout.master_addr}")
    unrouted = [(f.host, f.route.error if f.route else "no answer", lambda hosts, f=f: (
                 f"no route from {hosts} to {layout.master_addr}: {f.route.error if f.route else 'no answer'}"))
                for f in facts if f.route is None or f.route.dev is None]
    check.details += per_hosts(unrouted)
    for f in facts:
        for var in IFNAME_VARS:
            spec = layout.job.env.get(var) or f.env.get(var)
            if not spec:
                continue
            if f.links and not any(_ifname_matches(spec, link) for link in f.links):
                check.details.append(f"{var}={spec} matches no interface on {f.host} "
                                     f"(it has {', '.join(f.links)})")
            elif f.route and f.route.dev and not f.route.local and not _ifname_matches(spec, f.route.dev):
                check.notes.append(f"{f.host} routes to rank 0 through {f.route.dev}, not {var}={spec}")
    if check.details:
        check.failure = "interfaces wrong"
    return check


def check_port(facts: list[HostFacts], layout: Layout) -> Check | None:
    """The master port free on rank 0 (it could bind it) and reachable from every other host."""
    rank0 = facts[0]
    port = layout.master_port
    if rank0.rank != 0 or not rank0.port:
        return None
    answer = rank0.port
    label = f"master_port {port}"
    if answer.get("busy"):
        holders = re.findall(r'\("([^"]+)",pid=(\d+)', " ".join(answer.get("holders") or []))
        holder = ", ".join(f"{name} (pid {pid})" for name, pid in dict.fromkeys(holders))
        return Check("master_port", [(f"{port} in use", [rank0.host])], label=label,
                     failure=f"master port {port} in use on {rank0.host} (rank 0)",
                     details=[f"port {port} is already in use on {rank0.host} (rank 0): {answer['busy']}"
                              + (f"; held by: {holder}" if holder else "")
                              + " (a previous run still alive? another job?)"])
    others = {f.host: f.port or {} for f in facts[1:]}
    values = {h: ("reachable from" if p.get("reachable") else f"not reachable ({p.get('error') or 'no answer'})")
              for h, p in others.items()}
    groups = [(f"free on {rank0.host} (rank 0)", [rank0.host])] if not others else [
        (f"free on {rank0.host} (rank 0), {value}", hosts) for value, hosts in group_by_value(values)]
    check = Check("master_port", groups, label=label)
    bad = [h for h, v in values.items() if v != "reachable from"]
    if bad:
        check.failure = f"master port {port} on {rank0.host} not reachable"
        check.details = per_hosts([(h, "unreachable", lambda hosts: (
            f"{hosts} cannot connect to {rank0.host} port {port} (firewall? wrong ftb_master_addr?)")) for h in bad])
    if layout.all_local:
        check.notes.append("local only: reachability from other hosts not tested")
    return check


def check_probe(facts: list[HostFacts]) -> Check | None:
    """Facts a host's probe could not get (a bug or an odd host): shown, never hidden."""
    bad = [f for f in facts if f.problems]
    if not bad:
        return None
    check = Check("probe", [("incomplete", [f.host for f in bad])])
    check.warnings = [f"{f.host}: {p}" for f in bad for p in f.problems]
    return check


def evaluate(layout: Layout, facts: ClusterFacts, nproc_per_node: int | None) -> list[Check]:
    """Every rule on every host's facts."""
    hosts = facts.hosts
    remote = not layout.all_local
    checks = [check_ssh(hosts)] if remote else []
    reached = facts.reached
    if not reached:
        return checks
    if len(reached) > 1:
        checks.append(check_hostnames(reached))
    checks.append(check_system(reached))
    checks.append(check_runtime(reached, docker=layout.docker, mode=layout.job.train.mode,
                                python=layout.python or "python3"))
    checks += [c for c in [check_trackers(reached, layout)] if c is not None]
    checks += [c for c in [check_training(reached, layout)] if c is not None]
    checks.append(check_gpus(reached, layout, nproc_per_node))
    checks += [c for c in [check_health(reached, layout.job.health)] if c is not None]
    checks += [c for c in [check_storage_answers(reached)] if c is not None]
    checks.append(check_dirs(reached, layout))
    optional = [check_datasets(reached), check_model_bytes(reached)]
    if remote:
        checks.append(check_route(reached, layout))
        optional.append(check_storage(reached, "shared_dir", layout.shared_dir, fail=True))
        if layout.checkpoint_dir:
            optional.append(check_storage(reached, "output_dir", layout.checkpoint_dir, fail=False))
    if layout.checkpoint_dir and host_sees(layout, layout.checkpoint_dir):
        checks += [c for c in [check_output_dir(reached, layout.checkpoint_dir, docker=layout.docker)] if c is not None]
    optional += [check_checkpoint_space(reached, layout), check_port(reached, layout), check_probe(reached)]
    return checks + [c for c in optional if c is not None]
