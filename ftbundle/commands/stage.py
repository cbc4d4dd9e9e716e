"""`ftbundle stage JOB`: the job's ``stage:`` copied to every host's stage_dir, nothing run
(the cache warmed ahead of a run: ftbundle/stage.py)."""

from __future__ import annotations

import argparse

from ..errors import UserError
from .common import load_layout, open_cluster, say


def cmd_stage(args: argparse.Namespace) -> int:
    from ..stage import StageError, sources, stage_all

    job, layout = load_layout(args.job, args.inventory)
    if not job.stage:
        raise UserError("the job stages nothing: add 'stage: [model, dataset]' (or paths) to copy them to every "
                        "host before its runs", file=str(job.path), key="stage")
    sources(layout)  # (a name that means nothing is refused before any host is reached)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys) as cluster:
        if cluster.errors:
            raise UserError("cannot reach every host, nothing was copied: " + cluster.errors_said(),
                            file=str(job.inventory or job.path), key="hosts")
        try:
            stage_all(layout, cluster, say=say, on_hashing=say, run=False)
        except StageError as exc:
            say(f"staging failed: {exc}")
            return 1
    return 0
