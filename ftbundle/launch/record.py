"""The run's record at its end, beside its logs on shared storage (summary.json, attempts.json,
metrics.jsonl: what `ftbundle runs`, `status` and `plot` read), written through a node the run
can still reach; the failure as a notifier gets it; and, after the nodes stopped their jobs
themselves (their launcher paused or cut off), whether rank 0's host already told the run's end
(:func:`claim_end`)."""

from __future__ import annotations

from collections.abc import Iterable

from .. import rundir
from ..cluster import Cluster
from ..inventory import Host
from ..plan import Plan
from ..ui.progress import Progress
from .staging import stage_files
from .states import Outcome

RECORD_TIMEOUT_S = 5.0  # writing summary.json at the end of a run, through one host
RECORD_TRIES = 3  # hosts tried in turn for it (record_hosts)


def record_run(plan: Plan, cluster: Cluster, outcome: Outcome, *, attempt: int, started_wall: float,
               duration_s: float, attempts: list[dict] = (), recoveries: list[dict] = (),
               curve: list[dict] | None = None, gpus: dict | None = None) -> tuple[dict, Host | None]:
    """The run's record beside its logs (returned: summary.json's content, and the host it was written
    through, None if none took it): summary.json (state, exit, duration, final loss,
    each attempt's hosts) and metrics.jsonl (the trainer's log records of every attempt, each
    with its attempt: ``curve``; else this outcome's), for `ftbundle runs` and `ftbundle plot`.
    Best effort: a run that could not be recorded has still run."""
    import json

    from ..history import run_summary

    progress = outcome.progress or Progress()
    summary = run_summary(plan, exit_code=outcome.exit_code, interrupted=outcome.interrupted,
                          stalled=outcome.stalled, requested=outcome.requested,
                          attempt=attempt, started=started_wall, duration_s=duration_s, progress=progress,
                          failed_host=outcome.failure.host if outcome.failure else None,
                          failure=failure_said(outcome), launcher_lost=outcome.launcher_lost)
    if gpus is not None:  # (every attempt's readings, not the last one's alone: gpu_metrics.over_attempts)
        summary["gpus"] = gpus
    if len(attempts) > 1:
        summary["attempts"] = list(attempts)
    if recoveries:
        summary["recovery"] = list(recoveries)
    if outcome.gpu_faults:
        summary["gpu_faults"] = list(outcome.gpu_faults)
    files = {rundir.SUMMARY: json.dumps(summary, indent=2) + "\n"}
    if len(attempts) > 1:  # (`ftbundle status` reads it: each attempt's recovery, now known)
        files[rundir.ATTEMPTS] = json.dumps(list(attempts), indent=2) + "\n"
    records = curve if curve else progress.plot_records()
    if records:
        files[rundir.METRICS] = "".join(json.dumps(r) + "\n" for r in records)
    # through a node the run could still reach (rank 0's host may be the one that was lost, or
    # one whose SSH key exchange hangs: its transport is active, nothing sent to it goes out)
    for host in record_hosts(plan, cluster, outcome.lost):
        try:  # (briefly: an interrupted ftbundle must not wait long on a record)
            stage_files(cluster, host, plan.run_dir, files, timeout=RECORD_TIMEOUT_S)
            return summary, host
        except Exception:  # noqa: BLE001 - the next host, if any
            continue
    return summary, None


def claim_end(plan: Plan, cluster: Cluster, attempt: int, via: Host | None) -> dict | None:
    """Claim the attempt's ended.aN through ``via`` as rank 0's teller does (remote/tell.py: O_EXCL,
    one of them tells), where that teller may have started: the nodes stopped their jobs themselves,
    their launcher lost to them (a pause past their watchdog, a cut), and the launcher is about to
    tell the run's end, or to go on with another attempt (no end to tell). None: the launcher has
    it (the teller says nothing), or cannot know (no host: told twice is better than never); else
    the teller's record ({} while it is still being written)."""
    if via is None:
        return None
    import json

    claim = 'if ( set -C; printf "%s\\n" "$2" >"$1" ) 2>/dev/null; then echo claimed; else cat -- "$1"; fi'
    try:
        answer = cluster.run(via, ["sh", "-c", claim, "sh", plan.rundir.ended(attempt), f"the launcher ({plan.run_id})"],
                             timeout=RECORD_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - not known: it tells
        return None
    if not answer.ok or answer.stdout.strip() == "claimed":
        return None
    try:
        ended = json.loads(answer.stdout)
    except ValueError:
        ended = {}
    return ended if isinstance(ended, dict) else {}


def told_said(plan: Plan, attempt: int, ended: dict) -> str:
    """Who told the attempt's end, its launcher lost to it (claim_end's record), in words."""
    return (f"{ended.get('told_by') or plan.nodes[0].host.name} (rank 0) told the run's end, its launcher lost to it "
            f"({rundir.ended_name(attempt)}: {ended.get('state') or 'stopped: launcher lost'})")


def failure_said(outcome: Outcome) -> dict | None:
    """The failed node as a notifier gets it: host, node rank, exit code and the line why."""
    f = outcome.failure
    return None if f is None else {"host": f.host, "node_rank": f.rank, "code": f.code, "line": f.reason}


def record_hosts(plan: Plan, cluster: Cluster, lost: Iterable[int], tries: int = RECORD_TRIES) -> list[Host]:
    """Where the run's record is written through, in order, ``tries`` at most: the nodes not
    lost whose sends go out now (rank order), then those whose transport is up but held (a key
    exchange in progress), then rank 0's host whatever its state."""
    lost = set(lost)
    kept = [n.host for n in plan.nodes if n.rank not in lost and cluster.alive(n.host)]
    ready = [h for h in kept if cluster.can_send(h)]
    order = ready + [h for h in kept if h not in ready]
    if plan.nodes[0].host not in order:
        order.append(plan.nodes[0].host)
    return order[:tries]
