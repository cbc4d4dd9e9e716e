"""Entry point torchrun runs on every node for `train: llamafactory:` jobs.

Staged by ftbundle into the run directory (shared storage), so nodes need nothing but
LlamaFactory itself. It runs what `llamafactory.launcher` runs under torchrun (`run_exp()`), with:

* ``@record`` (torch elastic): a rank that dies of an exception writes its own traceback
  to ``TORCHELASTIC_ERROR_FILE`` (torchrun sets it per local rank under ``--log-dir``, in
  the run directory). ftbundle's failure summary shows that traceback, not torchrun's
  ChildFailedError wrapper around it.
* CPU ranks resuming from a checkpoint: accelerate names the device `cpu:0`, and
  `torch.load(map_location="cpu:0")` cannot restore storages tagged that way
  ("don't know how to restore data location ... cpu:0"), so every CPU resume dies
  in `_load_optimizer_and_scheduler`. A deserializer for `cpu:N` locations fixes it;
  GPU runs never reach it.

Credentials (hf_hub_token, ...) are never in the staged config, which lives on shared
storage: ftbundle sends them in the environment (FTB_LF_<KEY>, listed by FTB_LF_FROM_ENV),
and they are put back into the config here, in memory.

* The attempt fence: at the end of every optimizer step (before the trainer saves a checkpoint
  there) each rank reads the run directory's ``attempt`` file; once it names a later attempt
  than the rank's own ``FTB_ATTEMPT`` (ftbundle went on without this rank's host: it was lost,
  maybe only cut off), the rank ends at once (exit 97) without writing. Its node program's
  watchdog stops it anyway within seconds of losing the launcher; this holds even where that
  program is gone (docs/launcher.md, "A lost host").

* A rank whose training has returned leaves through ``leave()``: Python's exit handlers run
  while the interpreter is whole, stdout and stderr are flushed, and the process ends with
  ``os._exit``, skipping interpreter finalization and C++ static destructors. There, torch
  2.14 sometimes aborts a rank that has finished and saved ("terminate called without an
  active exception", SIGABRT, main thread with no Python frame): seen in clean-clone
  `make test` runs (one or two of its LlamaFactory runs, in 3 of 4 runs), always after
  "Training completed" and the saved model, and each such run was reported failed.
  A rank that raises still exits the normal way, through ``@record``, with its traceback.
"""

import atexit
import logging
import os
import sys
import time

_STARTED = time.monotonic()  # (before torch: the imports' time is said once they are done)

import torch.serialization
from torch.distributed.elastic.multiprocessing.errors import record


def _restore_cpu_n(obj, location):
    if isinstance(location, str) and location.startswith("cpu:"):
        return obj
    return None


torch.serialization.register_package(11, lambda obj: None, _restore_cpu_n)

def _credentials():
    keys = os.environ.get("FTB_LF_FROM_ENV", "").split()
    return {key: os.environ["FTB_LF_" + key.upper()] for key in keys if "FTB_LF_" + key.upper() in os.environ}


FENCED_EXIT = 97  # a rank of an attempt ftbundle has gone on from


def fenced() -> str | None:
    """The later attempt the run directory names, when it is not this rank's own; None
    while this rank's attempt is the current one (or outside ftbundle)."""
    attempt_file, mine = os.environ.get("FTB_ATTEMPT_FILE"), os.environ.get("FTB_ATTEMPT")
    if not attempt_file or not mine:
        return None
    try:
        with open(attempt_file) as f:
            current = f.read().strip()
    except OSError:
        return None
    return current if current.isdigit() and mine.isdigit() and int(current) > int(mine) else None


def _attempt_fence():
    from transformers import TrainerCallback

    class AttemptFence(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            current = fenced()
            if current is not None:
                print(f"ftbundle: attempt {os.environ['FTB_ATTEMPT']} is over (the run is on attempt {current} "
                      f"without this host): rank {os.environ.get('RANK', '?')} stops without writing",
                      file=sys.stderr, flush=True)
                os._exit(FENCED_EXIT)

    return AttemptFence()


def _step_times() -> list:
    """Each rank's step times for ftbundle's straggler detection (ftb_steptimes.py, staged
    beside this file: ftbundle/shims/steptimes.py); none where it is not there."""
    try:
        from ftb_steptimes import StepTimes
    except ImportError:
        return []
    return [StepTimes()]


@record
def main() -> None:
    from llamafactory.train.tuner import run_exp

    # where the time before the first step goes: the display's start-up parts (ui.progress)
    print(f"ftbundle: imported torch, transformers and LlamaFactory in {time.monotonic() - _STARTED:.1f} s",
          flush=True)

    credentials = _credentials()
    if credentials:
        import yaml

        with open(sys.argv[1]) as f:
            config = yaml.safe_load(f) or {}
        run_exp(args={**config, **credentials}, callbacks=[_attempt_fence(), *_step_times()])
    else:  # (what `python -m llamafactory.launcher CONFIG` runs under torchrun: run_exp() reads sys.argv)
        run_exp(callbacks=[_attempt_fence(), *_step_times()])


def leave(code: int = 0) -> None:
    """End the process after a successful run without interpreter finalization (see above)."""
    atexit._run_exitfuncs()  # what a normal exit runs first: trainer/logger hooks, logging.shutdown
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
    leave(0)
