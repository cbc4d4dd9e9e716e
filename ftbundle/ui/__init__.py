"""What a person watching ftbundle sees: phases, a live progress line, the closing and
failure summaries.

- :mod:`.progress`: training metrics from trainer_log.jsonl records, HF Trainer log dicts
  and tqdm bars, folded into one state (pure);
- :mod:`.stragglers`: every node's step times and the node that sets the pace (pure);
- :mod:`.summary`: the closing summary and the failure summary with its hint (pure text);
- :mod:`.phases`: the display itself: rich on a terminal, plain lines otherwise.
"""

from .phases import Phases
from .progress import Progress

__all__ = ["Phases", "Progress"]
