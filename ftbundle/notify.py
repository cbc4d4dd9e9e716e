"""A word when a run ends (issue 47 item 3): job key ``notify: {webhook: URL, command: CMD}``.

Called once, when the run has ended (finished, failed, stalled, a host lost, interrupted),
from the launcher, after summary.json is written: the webhook gets a POST of summary.json
(state, run id, hosts, duration, final loss, tokens/s, the failed host and its line), the
command runs on the launcher's machine (``sh -c CMD``) with summary.json on its stdin and
FTB_RUN_ID, FTB_STATE, FTB_EXIT_CODE in its environment. Both at once, each retried briefly
(a webhook that answers 5xx or does not connect: up to TRIES times) within LIMIT_S in all:
a notifier that fails or hangs is named, never holds the run's end longer than that. A URL
is only ever shown as its scheme and host (a token in its path or query is never printed).
A detached run is told by rank 0's watcher (remote/watch.py), with remote/notifier.py's same
sender: its state, exit code, duration and the failure's line (no launcher saw its loss or speed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .remote.notifier import LIMIT_S, RETRY_PAUSE_S, TRIES, post, run_command, shown  # noqa: F401 (the one sender)
from .remote import notifier


@dataclass(frozen=True)
class Notify:
    webhook: str | None = None
    command: str | None = None


def send(notify: Notify | None, summary: dict, say: Callable[[str], None], limit_s: float = LIMIT_S) -> None:
    """Both notifiers at once, within ``limit_s``; a failure is said, never raised."""
    if notify is not None:
        notifier.send(notify.webhook, notify.command, summary, say, limit_s)
