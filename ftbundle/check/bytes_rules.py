"""The same bytes on every host: the datasets (LlamaFactory's dataset_info.json files) and the
job's node-local model (seed trap "Nodes Out of Sync / Diverging Loss": two hosts whose model
copies differ by one byte train without a word, each from its own weights).

Pure, like every rule: the probe (ftbundle/remote/probe_files.py) hashes on the hosts,
remembering each file's digest while the file is unchanged; what lives on shared storage is
read by rank 0 alone (:func:`on_shared_dir`: ftbundle/check/__init__.py asks no other host).
"""

from __future__ import annotations

from ..facts import HostFacts
from ..hostlist import fold
from ..layout import Layout
from ..paths import is_under
from ..units import size_text
from .finding import Check, describe_groups, group_by_value

# the job's files (ftbundle/check/rules.py's job_paths) whose bytes are compared host to host
FINGERPRINTED = ("model_name_or_path",)
FILES_NAMED = 5  # the odd host's differing files named, then "and N more"


def on_shared_dir(layout: Layout, path: str) -> bool:
    """Whether ``path`` is under the job's shared_dir (which the check proves shared)."""
    return len(layout.hosts) > 1 and not layout.all_local and is_under(path, layout.shared_dir)


def files_apart(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The names of the files of one copy (``mine``) that are not those of another: its own
    bytes, missing, or extra."""
    said = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine:
            said.append(f"{name} missing")
        elif name not in theirs:
            said.append(f"{name} extra")
        elif mine[name] != theirs[name]:
            said.append(name)
    return said


def check_model_bytes(facts: list[HostFacts]) -> Check | None:
    """Each fingerprinted file (a model directory or file) with one digest on every host that
    has it; the hosts that differ from the rest named, with the files that differ. A copy not
    hashed within the probe's time is a warning (what was hashed is remembered: the next check
    goes on); a missing one is the job-fits rule's to name."""
    answers: dict[str, dict[str, dict]] = {}
    for f in facts:
        for key, fp in f.fingerprints.items():
            answers.setdefault(key, {})[f.host] = fp
    if not answers:
        return None
    check = Check("same bytes", [])
    for key, per_host in answers.items():
        path = next(iter(per_host.values())).get("path", "?")
        values: dict[str, str] = {}
        read = [fp["hashed"] for fp in per_host.values() if fp.get("hashed")]
        for host, fp in per_host.items():
            if "sha256" in fp:
                values[host] = f"sha256 {fp['sha256'][:16]}"
            elif "unfinished" in fp:
                done, total = fp["unfinished"]
                values[host] = "not hashed yet"
                check.warnings.append(f"{key} {path} on {host} not compared: {size_text(done)} of "
                                      f"{size_text(total)} hashed within the check's time (the hashed files are "
                                      "remembered: the next check goes on from there)")
            elif fp.get("error") != "missing":
                values[host] = str(fp.get("error"))
                check.details.append(f"{host}: {key} {path}: {fp.get('error')}")
        check.groups += [(f"{key} {path} {value}", hosts) for value, hosts in group_by_value(values)]
        hashed = group_by_value({h: v for h, v in values.items() if v.startswith("sha256")})
        if len(hashed) > 1:
            check.details.append(_differs(key, path, hashed, per_host))
        if len(per_host) == 1 and len(facts) > 1:
            check.notes.append(f"{key} {path} is on shared storage: read once, by {next(iter(per_host))}")
        if read:
            check.notes.append(f"{key}: {size_text(sum(read))} read and hashed on {len(read)} host(s); an unchanged "
                               "copy is not read again")
    if check.details:
        check.failure = "the job's files differ between hosts"
    return check


def _differs(key: str, path: str, hashed: list[tuple[str, list[str]]], per_host: dict[str, dict]) -> str:
    """`model_name_or_path /m differs between hosts: ...; node3 is the odd one (its
    model.safetensors differs)`: the odd hosts are those outside a strict majority (no
    majority: every group is named, none called odd)."""
    line = f"{key} {path} differs between hosts: {describe_groups(hashed)}"
    if len(hashed[0][1]) == len(hashed[1][1]):
        return line + " (no majority: which copy is right is yours to say)"
    odd = [h for _, hosts in hashed[1:] for h in hosts]
    line += f"; the odd host(s): {fold(odd)}"
    base = per_host[hashed[0][1][0]].get("each")
    if base is None:
        return line
    said = []
    for _, hosts in hashed[1:]:
        mine = per_host[hosts[0]].get("each")
        if mine is None:
            continue
        names = files_apart(mine, base)
        more = f" and {len(names) - FILES_NAMED} more" if len(names) > FILES_NAMED else ""
        said.append(f"{fold(hosts)}: {', '.join(names[:FILES_NAMED])}{more}")
    return line + (f" (files not as on {hashed[0][1][0]}: {'; '.join(said)})" if said else "")


def check_datasets(facts: list[HostFacts]) -> Check | None:
    """The same bytes of every dataset file on every host; a missing dataset_info.json,
    an unknown dataset or a missing file names the host, the file and the dataset."""
    if not any(f.datasets for f in facts):
        return None
    check = Check("datasets", [])
    per_file: dict[tuple[str, str], dict[str, str]] = {}
    for f in facts:
        for entry in f.datasets:
            if "remote" in entry:
                note = f"dataset {entry['dataset']!r} is not a local file ({entry['remote']}): not compared"
                if note not in check.notes:
                    check.notes.append(note)
                continue
            if "error" in entry:
                what = f"dataset {entry['dataset']!r}" if "dataset" in entry else "the datasets"
                check.details.append(f"{f.host}: {entry['file']} {entry['error']} (needed for {what})")
                if "dataset" in entry:
                    per_file.setdefault((entry["dataset"], entry["file"]), {})[f.host] = entry["error"]
                continue
            per_file.setdefault((entry["dataset"], entry["file"]), {})[f.host] = entry["sha256"][:16]
    for (dataset, path), hashes in per_file.items():
        groups = group_by_value(hashes)
        present = group_by_value({h: v for h, v in hashes.items() if len(v) == 16})
        if len(present) > 1:
            check.details.append(f"dataset {dataset!r} file {path} differs: {describe_groups(present)}")
        check.groups += [(f"{dataset} {path} " + (f"sha256 {value}" if len(value) == 16 else value), hosts)
                         for value, hosts in groups]
    readers = [f.host for f in facts if f.datasets]
    if len(readers) == 1 and len(facts) > 1:
        check.notes.append(f"the datasets are on shared storage: read once, by {readers[0]}")
    if check.details:
        check.failure = "dataset files differ or are missing"
    return check
