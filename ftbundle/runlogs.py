"""`ftbundle logs`: a run's output from its run directory on shared storage, one rank's or every
rank's merged in time order (``--all``), the last lines or followed as they come; each read on the
node's own host, else through another host of the run (:meth:`ftbundle.runs.RunRef.via`)."""

from __future__ import annotations

import re
import sys

from .cluster import Cluster, parallel
from .errors import UserError
from .launch.node import node_argv
from .plan import NodePlan
from .runs import RunRef


def parse_rank(text: str | None, nnodes: int, nproc: int | list[int]) -> tuple[int, int]:
    """``--rank``: a global rank ("5") or node:local ("2:1") -> (node rank, local rank).
    ``nproc``: the ranks per node, or each node's own (global ranks are contiguous per node)."""
    nprocs = list(nproc) if isinstance(nproc, (list, tuple)) else [nproc] * nnodes
    if text is None:
        return 0, 0
    node_text, sep, local_text = text.partition(":")
    try:
        if sep:
            node, local = int(node_text), int(local_text)
        else:
            node, local = -1, int(text)
            for i, count in enumerate(nprocs):
                if 0 <= local < count:
                    node = i
                    break
                local -= count
    except ValueError:
        node = local = -1
    if not (0 <= node < nnodes and 0 <= local < nprocs[node]):
        local_range = f"LOCAL 0-{nprocs[0] - 1}" if len(set(nprocs)) == 1 else \
            "LOCAL below the node's ranks (" + "+".join(map(str, nprocs)) + ")"
        raise UserError(f"no rank {text!r} in this run: give a global rank 0-{sum(nprocs) - 1} or "
                        f"NODE:LOCAL with NODE 0-{nnodes - 1} and {local_range}", key="--rank")
    return node, local


_HEADER = re.compile(r"^==> (.*) <==$")
_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:[,.](\d{1,6}))?")
_RANK_FILE = re.compile(r"/attempt_\d+/(\d+)/(stdout|stderr)\.log$")


def _timestamp(line: str) -> str | None:
    match = _TIME.search(line)
    return f"{match.group(1)} {match.group(2)}.{(match.group(3) or '0').ljust(6, '0')}" if match else None


def merge_by_time(streams: list[tuple[str, list[str]]]) -> list[tuple[str, str]]:
    """(prefix, lines) per file -> (prefix, line) in time order. Pure. A line's time is the
    newest timestamp at or before it in its file (the logging formats of LlamaFactory,
    transformers and Python's logging print one); lines before a file's first timestamp take
    that one. So a traceback stays right after the line before it, and files without any
    timestamp keep their own order, one after the other."""
    keyed = []
    for index, (prefix, lines) in enumerate(streams):
        current = next((t for t in map(_timestamp, lines) if t), "")
        for number, line in enumerate(lines):
            current = _timestamp(line) or current
            keyed.append(((current, index, number), prefix, line))
    keyed.sort(key=lambda item: item[0])
    return [(prefix, line) for _, prefix, line in keyed]


class _Prefixer:
    """One host's `tail -v` output -> (file path, line) as it comes: a header says which
    file the lines after it are from."""

    def __init__(self):
        self.path = ""
        self.partial = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out = []
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            match = _HEADER.match(line)
            if match:
                self.path = match.group(1)
            else:
                out.append((self.path, line))
        return out


def _prefix_of(ref: RunRef, node: NodePlan, path: str) -> str:
    """`host:global-rank` of a file: the node's log is its local rank 0."""
    match = _RANK_FILE.search(path)
    local = int(match.group(1)) if match and path != ref.files(node).log else 0
    return f"{node.host.name}:{node.first_rank + local}"


def _tail_argv(ref: RunRef, node: NodePlan, lines: int, follow: bool, locals_: list[int]) -> list[str]:
    """node.sh's tail-ranks: the node's log and its local ranks' files, the last lines (and
    with ``follow`` the new ones, with what the follow says of a storage that does not answer)."""
    files = ref.files(node)
    ranks_dir = ref.rundir.rank_logs(node.rank)
    return node_argv("tail-ranks", str(lines), "1" if follow else "0", files.marker, files.log, ranks_dir,
                     ref.shared_dir, *map(str, locals_))


def _start_on(cluster: Cluster, ref: RunRef, node: NodePlan, argv: list[str]):
    """A command about ``node``'s files: on its own host, else rank 0's (shared storage)."""
    for host in dict.fromkeys([node.host, ref.via(cluster)]):
        if not cluster.alive(host):
            continue
        try:
            proc = cluster.start(host, argv)
        except Exception:  # noqa: BLE001 - the next host may do
            continue
        proc.close_stdin()
        return proc
    raise UserError(f"cannot reach {node.host.name} nor any other host of the run to read its logs in {ref.run_dir}")


def show_all_logs(ref: RunRef, cluster: Cluster, follow: bool, lines: int, out=None,
                  only: tuple[int, int] | None = None) -> int:
    """Every node's and local rank's output (or only (node, local)'s), each line prefixed
    ``host:rank`` (its global rank): the last ``lines`` of each file merged in time order;
    with ``follow``, the last lines and then the new ones of every file as they come (that
    is their time order), until every node's job has ended. One command per host, over the one connection the cluster holds to it."""
    out = out or sys.stdout
    nodes = [n for n in ref.nodes if only is None or n.rank == only[0]]

    def locals_(node: NodePlan) -> list[int]:  # each node's own local ranks (hosts may run different counts)
        return [only[1]] if only is not None else list(range(node.nproc))

    def backlog(node: NodePlan) -> list[tuple[str, list[str]]]:
        proc = _start_on(cluster, ref, node, _tail_argv(ref, node, lines, False, locals_(node)))
        text = b""
        while chunk := proc.read_out():
            text += chunk
        proc.wait(5)
        files: dict[str, list[str]] = {}
        for path, line in _Prefixer().feed(text.decode(errors="replace") + "\n"):
            if path and line:
                files.setdefault(path, []).append(line)
        return [(_prefix_of(ref, node, path), file_lines) for path, file_lines in files.items()]

    if not follow:
        streams = [stream for per_node in parallel(backlog, nodes) for stream in per_node]
        for prefix, line in merge_by_time(streams):
            out.write(f"{prefix} {line}\n")
        out.flush()
        return 0
    import threading  # following: each file's last lines, then its new ones, all as they come

    lock = threading.Lock()

    def pump(node: NodePlan) -> None:
        proc = _start_on(cluster, ref, node, _tail_argv(ref, node, lines, True, locals_(node)))
        said = _relay_stderr(proc)  # (what the follow says of a storage that does not answer)
        prefixer = _Prefixer()
        while chunk := proc.read_out():
            with lock:
                for path, line in prefixer.feed(chunk.decode(errors="replace")):
                    if path and line:
                        out.write(f"{_prefix_of(ref, node, path)} {line}\n")
                out.flush()
        proc.wait(5)
        said.join(5)

    parallel(pump, nodes)
    return 0


def show_logs(ref: RunRef, cluster: Cluster, rank: str | None, follow: bool, lines: int, out=None,
              all_ranks: bool = False) -> int:
    """One rank's output (``--rank``: global, or node:local; default: rank 0's node log), or
    with ``all_ranks`` every rank's, merged (:func:`show_all_logs`)."""
    if all_ranks:
        if rank is not None:
            raise UserError("--all shows every rank: drop --rank, or drop --all for one rank", key="--rank")
        return show_all_logs(ref, cluster, follow, lines, out)
    node_rank, local = parse_rank(rank, len(ref.nodes), [n.nproc for n in ref.nodes])
    if local:
        return show_all_logs(ref, cluster, follow, lines, out, only=(node_rank, local))
    out = out or sys.stdout
    node = ref.nodes[node_rank]
    files = ref.files(node)
    argv = (node_argv("follow", files.marker, files.log, str(lines), ref.shared_dir) if follow
            else ["tail", "-n", str(lines), "--", files.log])
    # The log is on shared storage: another host can read any node's log if the node's own is gone.
    for host in dict.fromkeys([node.host, ref.via(cluster)]):
        if not cluster.alive(host):
            continue
        try:
            proc = cluster.start(host, argv)
        except Exception:
            continue
        proc.close_stdin()
        said = _relay_stderr(proc)  # (the follow says there when the shared storage does not answer)
        while chunk := proc.read_out():
            out.write(chunk.decode(errors="replace"))
            out.flush()
        code = proc.wait(5) or 0
        said.join(5)
        return 1 if code == 3 else code  # 3: the log's end could not be read (the follow said why)
    raise UserError(f"cannot reach {node.host.name} nor any other host of the run to read {files.log}")


def _relay_stderr(proc):
    """A thread that copies a remote command's stderr to ours as it comes."""
    import threading

    def relay() -> None:
        while chunk := proc.read_err():
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()

    thread = threading.Thread(target=relay, daemon=True, name="stderr")
    thread.start()
    return thread
