"""Launch a plan on an open cluster and supervise it to its end.

- :mod:`.node`: one node's channels (control and log) and the events they make;
- :mod:`.supervisor`: the event loop (node states), teardown, detach;
- :mod:`.attempts`: restarts, and what a lost host leads to (the job's ``on_node_loss``);
- :mod:`.display`: rank 0's lines on the terminal, through a queue that never blocks.

The node side is ``ftbundle/remote/node.sh``.
"""

from .attempts import Policy, fence, launch
from .supervisor import Outcome, StagingError, Supervisor, launch_detached, read_tail, stage_files, stage_run_dir

__all__ = ["Outcome", "Policy", "StagingError", "Supervisor", "fence", "launch", "launch_detached", "read_tail",
           "stage_files", "stage_run_dir"]
