"""Launch a plan on an open cluster and supervise it to its end.

- :mod:`.node`: one node's channels (control and log) and the events they make;
- :mod:`.supervisor`: the event loop; :mod:`.states`: node states, the pure decisions on them, an
  attempt's outcome;
- :mod:`.teardown`: stopping every node; :mod:`.failure`: the failing rank's story, in words;
- :mod:`.staging`: the run directory written before any node starts; :mod:`.detached`: a detached start;
- :mod:`.attempts`: restarts, and what a lost host leads to (the job's ``on_node_loss``);
- :mod:`.display`: rank 0's lines on the terminal, through a queue that never blocks.

The node side is ``ftbundle/remote/node.sh``.
"""

from .attempts import Policy, fence, launch
from .detached import launch_detached
from .failure import read_tail
from .staging import StagingError, stage_files, stage_run_dir
from .states import Outcome
from .supervisor import Supervisor

__all__ = ["Outcome", "Policy", "StagingError", "Supervisor", "fence", "launch", "launch_detached", "read_tail",
           "stage_files", "stage_run_dir"]
