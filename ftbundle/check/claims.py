"""The check's verdict on a run's claims (remote/claims.py; layout.claim_keys): a host whose port
or GPUs another run holds refuses the run, naming that run, and the claims this run took are
removed when it is refused. Pure but for :func:`claimed`'s use by the caller."""

from __future__ import annotations

from ..facts import ClusterFacts
from ..hostlist import fold
from ..inventory import Host
from ..layout import Layout
from .rules import Check


def _said(key: str) -> str:
    if key.startswith("port-"):
        return f"master port {key[5:]}"
    if key == "gpus":
        return "its GPUs"
    return f"GPU {key[4:]}"


def claim_check(layout: Layout, facts: ClusterFacts) -> Check | None:
    """None when no host was asked to claim; else a Check that fails where another run holds a
    claim, with the run, what it holds, where, and how to go on."""
    asked = [f for f in facts.reached if f.claim is not None]
    if not asked:
        return None
    held: dict[tuple[str, str], list[str]] = {}
    for f in asked:
        for t in f.claim.get("taken") or []:
            held.setdefault((str(t.get("run")), _said(str(t.get("key")))), []).append(f.host)
    ok = [f.host for f in asked if not f.claim.get("taken")]
    if not held:
        return Check("claims", [(f"free for run {layout.run_id}", ok)])
    details = [f"{fold(hosts)}: {what} held by run {run} (a run already going on these hosts: two would collide "
               f"on the port or the GPUs)" for (run, what), hosts in sorted(held.items())]
    runs = sorted({run for run, _ in held})
    details.append(f"wait for {' and '.join(runs)} to end, stop it (ftbundle stop {layout.job.path} --run "
                   f"{runs[0]}), or choose other hosts or another master_port")
    return Check("claims", [("held by another run", sorted(h for hosts in held.values() for h in hosts))],
                 failure=f"held by run {', '.join(runs)}", details=details)


def claimed(layout: Layout, facts: ClusterFacts) -> list[tuple[Host, list[str]]]:
    """(host, claim files) this run took: removed when it is refused after its check."""
    hosts = {h.name: h for h in layout.hosts}
    out = []
    for f in facts.reached:
        if f.claim and f.claim.get("held"):
            out.append((hosts[f.host], [f"{f.claim['dir']}/{key}@{layout.run_id}" for key in f.claim["held"]]))
    return out
