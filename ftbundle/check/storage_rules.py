"""The check's rules about where the job writes: shared storage proved by sentinels, and
LlamaFactory's output_dir writable on every host (apart from rules.py, which imports them)."""

from __future__ import annotations

from ..facts import HostFacts
from ..hostlist import fold
from .finding import Check, group_by_value, per_hosts

KERNEL_FS = ("/proc", "/sys", "/dev")


def check_storage(facts: list[HostFacts], name: str, path: str, *, fail: bool) -> Check | None:
    """Every host sees every other host's sentinel under ``path``: that, not a path, proves
    the storage shared. ``fail``: a failure (shared_dir) or a warning (output_dir)."""
    asked = [f for f in facts if name in f.storage and f.storage[name].written is not None]
    if len(asked) < 2:
        return None
    writers = {f.rank: f.host for f in asked if f.storage[name].written}
    said: dict[tuple[int, ...], str] = {}  # (a healthy fleet's hosts all see the same: folded once, not once a host)

    def sees(seen: tuple[int, ...]) -> str:
        if seen not in said:
            said[seen] = f"sees {fold(writers[r] for r in seen) or 'no sentinel'}"
        return said[seen]

    values = {f.host: sees(tuple(r for r in f.storage[name].seen if r in writers)) for f in asked}
    check = Check(name, group_by_value(values), label=f"{name} {path}")
    found = []
    for f in asked:
        s = f.storage[name]
        if not s.written:
            found.append((f.host, ("write", s.where, s.error), lambda hosts, s=s: (
                f"cannot write to {s.where or path} on {hosts}" + (f" ({s.error})" if s.error else ""))))
            continue
        missing = fold(host for rank, host in writers.items() if rank not in s.seen)
        if missing:
            found.append((f.host, ("unseen", missing, s.where), lambda hosts, missing=missing, s=s: (
                f"{hosts} does not see the sentinel of {missing} in {s.where}")))
    problems = per_hosts(found)
    wheres = {f.storage[name].where for f in asked if f.storage[name].where}
    if problems:
        what = f"{name} {path} is not shared by all hosts"
        if len(wheres) > 1:
            problems.append(f"{path} (or its nearest existing parent) differs between hosts: {', '.join(sorted(wheres))}")
        if fail:
            check.failure = what
            check.details = problems
        else:
            check.warnings += [what + ": checkpoints written there are lost with the node, and other nodes "
                               "cannot resume from them"] + problems
    return check


def check_output_dir(facts: list[HostFacts], path: str, *, docker: bool = False) -> Check | None:
    """LlamaFactory's output_dir can be made and written on every host: the probe's sentinel
    went under it (or its nearest existing parent, where a run would create it). A regular
    file at that path, a kernel file system, a read-only or foreign directory fail here: the
    run would fail after its start-up (30-45 s on every host) on the first save, or at once.
    None when no host was asked (a read-only probe). With the docker runtime the ranks write
    as the container's user (root, unless the image says otherwise), not the SSH user that
    asked: a permission the SSH user lacks is not judged there."""
    asked = [f for f in facts if "output_dir" in f.storage and f.storage["output_dir"].written is not None]
    if not asked:
        return None
    failing = [f for f in asked if not f.storage["output_dir"].written
               and not (docker and f.storage["output_dir"].error == "Permission denied")]
    if not failing:
        return None  # (written everywhere: check_storage says whether it is shared)
    found = []
    for f in failing:
        s = f.storage["output_dir"]
        where = s.where or path
        if any(where == k or where.startswith(k + "/") for k in KERNEL_FS):
            why = f"{where} is a kernel file system (nothing can be saved there)"
        else:
            why = f"{where}: {s.error or 'not writable'}"
        found.append((f.host, why, lambda hosts, why=why: f"{hosts}: {why}"))
    check = Check("output_dir", [(f"{path}: not writable", [f.host for f in failing])],
                  failure=f"LlamaFactory's output_dir {path} cannot be written",
                  label=f"output_dir {path}")
    check.details = per_hosts(found) + [
        "the trainer saves its checkpoints and adapter there: give output_dir (LlamaFactory config) a directory "
        "the training user can create and write on every host, on shared storage to resume from it"]
    return check
