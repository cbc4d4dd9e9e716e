"""The first real checkpoint's size against the room left for the rest (issue 46 item 4).

`check` estimates a checkpoint from the model and mode before the run (check/checkpoint_rules.py).
During the run the first checkpoint this attempt writes replaces the estimate: once the step
after it is seen (the Trainer saves between steps, so the save is over), its size (``du``) and
the free space where output_dir lives (``df``) are read on rank 0's host, on a thread of their
own, and said once: how many more fit, against how many the run still writes (at most
``save_total_limit``, plus the one written before the oldest is removed). Too few is a warning.
Only for LlamaFactory runs that save by steps (``save_strategy: steps``, the default).
"""

from __future__ import annotations

import posixpath
import shlex
import threading

from ..units import size_text


def needs(first_save: int, save_steps: int, total: int | None, limit: int | None) -> int | None:
    """How many more checkpoints the run must find room for after the one at ``first_save``
    (pure): the saves still to come, or, with ``save_total_limit``, at most that many (the
    Trainer writes the new one before it removes the oldest). None: unknown (no step count)."""
    if not total:
        return limit
    more = max(0, (total - first_save) // save_steps)
    return more if limit is None else min(more, limit)


def verdict(name: str, size: int, free: int, host: str, more: int | None, limit: int | None) -> tuple[str, bool]:
    """(the line, whether it is a warning) for the first checkpoint's figures (pure)."""
    fit = free // size if size > 0 else None
    room = (f"{fit} more fit in the {size_text(free)} free where output_dir is (on {host})" if fit is not None
            else f"{size_text(free)} free where output_dir is (on {host})")
    kept = f" (save_total_limit {limit})" if limit is not None else ""
    if more is None:
        return f"{name} holds {size_text(size)}; {room}", False
    line = f"{name} holds {size_text(size)}; {room}; the run writes {more} more{kept}"
    if fit is not None and fit < more:
        return (line + ": the disk fills before the run ends; free space there or lower save_total_limit "
                "(a full disk is named as ENOSPC, the last complete checkpoint is resumed)"), True
    return line, False


class CheckpointWatch:
    """Reads the first checkpoint of the attempt once (:meth:`tick` from the supervisor's loop);
    :meth:`said` gives its line once, on the loop's thread."""

    def __init__(self, plan, cluster, config: dict | None, start_step: int = 0):
        self.plan, self.cluster = plan, cluster
        lf = config is not None
        config = config or {}
        steps = config.get("save_steps", 500)
        self.save_steps = int(steps) if isinstance(steps, (int, float)) and steps >= 1 else 0
        self.limit = config.get("save_total_limit") if isinstance(config.get("save_total_limit"), int) else None
        self.enabled = bool(lf and plan.checkpoint_dir and self.save_steps and
                            str(config.get("save_strategy", "steps")) == "steps")
        self.first = (start_step // self.save_steps + 1) * self.save_steps if self.enabled else 0
        self._started = False
        self._result: tuple[str, bool] | None = None
        self._given = False

    def tick(self, step: int | None, total: int | None) -> None:
        """The step the run is at (rank 0's progress): past the first save, its size is read."""
        if not self.enabled or self._started or step is None or step <= self.first:
            return
        self._started = True
        threading.Thread(target=self._read, args=(total,), daemon=True, name="checkpoint-size").start()

    def _read(self, total: int | None) -> None:
        name = f"checkpoint-{self.first}"
        path = posixpath.join(self.plan.checkpoint_dir, name)
        host = self.plan.nodes[0].host
        script = (f"du -sb -- {shlex.quote(path)} | cut -f1; "
                  f"df -B1 --output=avail -- {shlex.quote(self.plan.checkpoint_dir)} | tail -n 1")
        try:
            answer = self.cluster.run(host, ["sh", "-c", script], timeout=60)
            size, free = (int(v) for v in answer.stdout.split()[:2])
        except Exception:  # noqa: BLE001 - not there (a save that failed is said by the run), or unreadable: silent
            return
        more = needs(self.first, self.save_steps, total, self.limit)
        self._result = verdict(name, size, free, host.name, more, self.limit)

    def said(self) -> tuple[str, bool] | None:
        """The line and whether it warns, once, when it is known."""
        if self._result is None or self._given:
            return None
        self._given = True
        return self._result
