"""Work for many hosts at once, on daemon threads that never hold up an interrupted launcher."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def parallel(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None) -> list[R]:
    """``[fn(x) for x in items]``, all at once on daemon threads (at most ``workers`` of
    them, each taking the next item, when given).

    Waiting is interruptible (Ctrl-C reaches the caller at once) and nothing joins the
    threads at exit, so an interrupted launcher never waits for a slow host. Exceptions
    from ``fn`` are re-raised in the caller.
    """
    items = list(items)
    if len(items) == 1:
        return [fn(items[0])]
    results: list = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)

    def work(i: int, item: T) -> None:
        try:
            results[i] = fn(item)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[i] = exc

    if workers is not None and workers < len(items):
        queue = iter(list(enumerate(items)))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    job = next(queue, None)
                if job is None:
                    return
                work(*job)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    else:
        threads = [threading.Thread(target=work, args=(i, x), daemon=True) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)
    for exc in errors:
        if exc is not None:
            raise exc
    return results
