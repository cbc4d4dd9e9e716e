"""Launch a plan on an open cluster and supervise it to its end.

- :mod:`.node`: one node's channels (control and log) and the events they make;
- :mod:`.supervisor`: the event loop (node states), teardown, restarts, detach;
- :mod:`.display`: rank 0's lines on the terminal, through a queue that never blocks.

The node side is ``ftbundle/remote/node.sh``.
"""

from .supervisor import (Outcome, StagingError, Supervisor, fence, launch, launch_detached, read_tail,
                         stage_files, stage_run_dir)

__all__ = ["Outcome", "StagingError", "Supervisor", "fence", "launch", "launch_detached", "read_tail",
           "stage_files", "stage_run_dir"]
