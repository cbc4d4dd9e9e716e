"""How a run's attempts are said: each restart's hosts and why (attempts.json, written by
:mod:`ftbundle.launch.attempts`), and how long it took to train again. Read back by
``ftbundle runs`` and ``status`` (history, runs) and said by the launcher at the run's end.
Pure."""

from __future__ import annotations

RECOVERY_PARTS = ("detection", "teardown", "preflight", "fence_wait", "start", "resume")  # (launch.attempts.recovery)


def attempts_said(records: list | None) -> list[str]:
    """The lines an attempts record says: for each attempt after a loss, where it ran and why
    ("attempt 2 on node[0-1]: node2 lost (...); global batch 12 kept: ..."), and when it
    trained again (its "recovery", once known: :func:`recovery_said`). Pure."""
    lines = []
    for r in records or []:
        if isinstance(r, dict) and r.get("why"):
            lines.append(str(r["why"]))
            said = recovery_said(r.get("attempt"), r.get("recovery"))
            if said:
                lines.append("  " + said)
    return lines


def recovery_said(attempt: int, parts: dict | None) -> str | None:
    """"attempt 2 trained again 38 s after the loss: detection 6 s, teardown 2 s, ..."; None
    when its first step was never seen (a command job, or it failed before)."""
    number = (int, float)
    if not isinstance(parts, dict) or not isinstance(parts.get("total"), number):
        return None
    said = ", ".join(f"{name.replace('_', ' ')} {parts[name]:.0f} s" for name in RECOVERY_PARTS
                     if isinstance(parts.get(name), number))
    return f"attempt {attempt} trained again {parts['total']:.0f} s after the failure: {said}"
