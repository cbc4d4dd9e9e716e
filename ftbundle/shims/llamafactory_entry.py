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

* The trackers' runs (``report_to``): once the trainer has begun, rank 0 writes which MLflow and
  W&B runs it logs to into the run directory (``trackers.json``: ids, experiment or project, the
  store or URL, W&B's offline directory; a URI's user and password left out), where `ftbundle
  runs` reads them. A later attempt of the same run (a restart, a lost host replaced), or a run
  that resumes this one's checkpoint (ftbundle stages that record as its own), continues them
  rather than beginning new ones: rank 0 sets ``MLFLOW_RUN_ID`` (and
  ``MLFLOW_MAX_LOG_PARAMS=0``: the params are the first attempt's, and MLflow refuses a changed
  value) and ``WANDB_RUN_ID`` with ``WANDB_RESUME=allow``, each unless the job's env sets it.

* A tracker's server that does not answer does not hold the run's end. MLflow sends the
  metrics from a queue; with its server gone each send retries for about 4 minutes, 10 at a time,
  and ``end_run`` (transformers calls it when training ends, before the model is saved) waits
  for every one: seen here, a LoRA whose MLflow server stopped at step 8 sat at "step 40/40"
  past 10 minutes with its adapter unsaved, every failed send's ERROR line keeping the stall
  clock from firing. So rank 0 says the first failed send
  at once (a warning the launcher shows, with the server and the reason), ends its MLflow run
  at the rank's exit instead (after the model is saved), and where a tracker's server is in
  trouble (MLflow's failed sends, or MLflow's or W&B's server not taking a connect) the rank's
  exit handlers (MLflow's queue, W&B's upload) get ``FTB_TRACKERS_END_S`` (300 s: one whole
  MLflow retry, so a server back within minutes takes every metric) before the rank leaves
  without them, said. Without that evidence nothing is cut: W&B uploading a model's artifacts
  to a server that answers may take long. Every loss is in trainer_log.jsonl either way.

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
import json
import logging
import os
import re
import sys
import threading
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
    return [StepTimes(tokens=False)]  # (the run's tokens: the trainer's log, read by the launcher)


TRACKER_RUNS = "trackers.json"  # (ftbundle/rundir.py TRACKER_RUNS)


def _tracker_runs_path() -> str | None:
    run_dir = os.environ.get("FTB_RUN_DIR")
    return os.path.join(run_dir, TRACKER_RUNS) if run_dir else None


def _read_tracker_runs() -> dict:
    try:
        with open(_tracker_runs_path() or "") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _mlflow_run_missing(run_id: str, environ) -> str | None:
    """Why MLflow could not go on with run ``run_id`` here (None: it can): MLflow raises at the
    trainer's start for a run its store does not hold (the job's MLFLOW_TRACKING_URI changed) or
    one outside the experiment the job names (MLFLOW_EXPERIMENT_NAME / _ID changed)."""
    store = environ.get("MLFLOW_TRACKING_URI") or "MLflow's default store"
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        run = client.get_run(run_id)
        name, wanted = environ.get("MLFLOW_EXPERIMENT_NAME"), environ.get("MLFLOW_EXPERIMENT_ID")
        if wanted and wanted != run.info.experiment_id:
            return f"it is in experiment {run.info.experiment_id}, the job names {wanted}"
        if name and name != client.get_experiment(run.info.experiment_id).name:
            return f"it is not in experiment {name!r}, which the job names"
    except Exception as exc:  # noqa: BLE001 - any reason is said, and a new run begins
        return f"{_without_userinfo(store)}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def continue_trackers(environ=os.environ) -> list:
    """Rank 0 of a later attempt, or of a run resuming another's checkpoint: the tracker runs
    the record names are continued (the environment their clients read); what is continued,
    said. An MLflow run its store cannot go on with is not: a new one begins, and why is said."""
    if environ.get("RANK", "0") != "0":
        return []
    found, said = _read_tracker_runs(), []
    mlflow = found.get("mlflow") if isinstance(found.get("mlflow"), dict) else {}
    missing = mlflow.get("run_id") and "MLFLOW_RUN_ID" not in environ and _mlflow_run_missing(mlflow["run_id"], environ)
    if missing:
        print(f"ftbundle: mlflow run {mlflow['run_id']} is not continued ({missing}): a new one begins", flush=True)
    elif mlflow.get("run_id") and "MLFLOW_RUN_ID" not in environ:
        environ["MLFLOW_RUN_ID"] = str(mlflow["run_id"])
        environ.setdefault("MLFLOW_MAX_LOG_PARAMS", "0")
        said.append(f"mlflow run {mlflow['run_id']}")
    wandb = found.get("wandb") if isinstance(found.get("wandb"), dict) else {}
    if wandb.get("id") and "WANDB_RUN_ID" not in environ:
        environ["WANDB_RUN_ID"] = str(wandb["id"])
        environ.setdefault("WANDB_RESUME", "allow")
        said.append(f"wandb run {wandb['id']}")
    if said:
        by = f"run {found['from_run']}'s" if found.get("from_run") and not found.get("began") else \
            f"begun by attempt {found.get('began', '?')}"
        print(f"ftbundle: attempt {environ.get('FTB_ATTEMPT', '?')} continues {' and '.join(said)} ({by})", flush=True)
    return said


def _without_userinfo(uri: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def tracker_runs() -> dict:
    """The MLflow and W&B runs this process logs to (the clients the trainer has imported)."""
    found = {}
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow is not None and hasattr(mlflow, "active_run") else None
    if run is not None:
        found["mlflow"] = {"run_id": run.info.run_id, "name": run.info.run_name,
                           "experiment_id": run.info.experiment_id,
                           "tracking_uri": _without_userinfo(str(mlflow.get_tracking_uri()))}
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        offline = bool(getattr(run, "offline", False))
        found["wandb"] = {"id": run.id, "name": run.name, "project": run.project, "entity": run.entity or None,
                          "url": None if offline else run.url, "offline": offline,
                          "dir": os.path.dirname(run.dir) if offline else None}
    return found


def keep_tracker_runs() -> None:
    """Rank 0: write what :func:`tracker_runs` finds to the run directory (the attempt that
    began them kept). A record it cannot make is said, never raised: training goes on."""
    path = _tracker_runs_path()
    try:
        found = tracker_runs()
    except Exception as exc:  # noqa: BLE001 - a client's attribute missing in some version
        print(f"ftbundle: the trackers' runs were not kept: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return
    if not path or not found:
        return
    before, attempt = _read_tracker_runs(), int(os.environ.get("FTB_ATTEMPT", "1") or 1)
    ids = {"mlflow": "run_id", "wandb": "id"}
    same = bool(before) and all((before.get(k) or {}).get(ids[k]) == run[ids[k]] for k, run in found.items())
    dirs = (before.get("wandb_dirs") or [] if same else []) + [found.get("wandb", {}).get("dir")]
    record = {**(before if same else {}), "attempt": attempt, **found,  # (offline: a directory an attempt)
              "wandb_dirs": [d for i, d in enumerate(dirs) if d and d not in dirs[:i]]}
    if not (same and (before.get("began") or before.get("from_run"))):
        record["began"] = attempt  # (the runs were begun here; else: by an earlier attempt, or another run)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        print(f"ftbundle: the trackers' runs were not kept in {path}: {exc}", file=sys.stderr, flush=True)


def _tracker_record():
    from transformers import TrainerCallback

    class TrackerRuns(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # (after the trackers' own callbacks)
            if state.is_world_process_zero:
                keep_tracker_runs()

    return TrackerRuns()


TRACKERS_END_S = 300.0  # a finished rank's exit waits this long for its trackers' servers (FTB_TRACKERS_END_S)
MLFLOW_QUEUE_LOGGER = "mlflow.utils.async_logging.async_logging_queue"  # (its ERROR: a send that failed)


def trackers_end_s(environ=os.environ) -> float:
    """How long a finished rank's exit handlers may wait on the trackers' servers."""
    try:
        return max(1.0, float(environ.get("FTB_TRACKERS_END_S") or TRACKERS_END_S))
    except ValueError:
        return TRACKERS_END_S


def _mlflow_store() -> str:
    mlflow = sys.modules.get("mlflow")
    try:
        return _without_userinfo(str(mlflow.get_tracking_uri())) if mlflow is not None else "?"
    except Exception:  # noqa: BLE001 - only said
        return "?"


def _why(message: str) -> str:
    """The reason in one of MLflow's failed-send messages, without its URLs (a URL may hold a
    user and password): the innermost cause as the system says it ("[Errno 111] Connection
    refused"; a kept-alive connection the server dropped: "[Errno 104] Connection reset by
    peer", "RemoteDisconnected: Remote end closed connection without response"), else the
    message's last words."""
    found = re.search(r"\[Errno -?\d+\][^'\")]*", message)
    if found:
        return found.group(0).strip()
    found = re.search(r"\w+Error\((-?\d+), '([^']*)'\)", message)  # (urllib3's way: ConnectionResetError(104, '...'))
    if found:
        return f"[Errno {found.group(1)}] {found.group(2)}"
    inner = re.findall(r"(\w+)\('([^']+)'\)", message)  # (the last named cause: RemoteDisconnected('...'))
    said = f"{inner[-1][0]}: {inner[-1][1]}" if inner else message.rpartition("Exception: ")[2]
    said = re.sub(r"https?://\S+", "<url>", said).strip()
    if len(said) > 200:  # (its last words, from a word's start)
        said = "..." + said[-200:].partition(" ")[2]
    return said


class TrackerSends(logging.Filter):
    """Rank 0's failed MLflow sends (MLflow's queue logs each as an ERROR): the first is said as a
    warning at once, the rest counted for the exit's word. MLflow's line names the URL it sent to,
    a user and password in it too: they are cut from the record before any handler writes it."""

    def __init__(self):
        super().__init__()
        self.failed = 0

    def filter(self, record):
        message = record.getMessage()
        if "://" in message and "@" in message:
            record.msg, record.args = re.sub(r"(https?://)[^/@\s]+@", r"\1", message), ()
        if "Failed to log run data" not in message:
            return True
        self.failed += 1
        if self.failed == 1:
            print(f"ftbundle: warning: mlflow cannot send this run's metrics to its server ({_mlflow_store()}): "
                  f"{_why(record.getMessage())}. MLflow retries each send for about 4 minutes while training goes "
                  f"on; the run's end waits at most {trackers_end_s():g} s for it (FTB_TRACKERS_END_S), and every "
                  "loss is in trainer_log.jsonl", file=sys.stderr, flush=True)
        return True


_SENDS = TrackerSends()
_MLFLOW_END_DEFERRED = False  # rank 0's MLflow run is ended at its exit (leave), not when training ends


def _end_mlflow_at_exit() -> None:
    """Rank 0: transformers' MLflowCallback ends its run when training ends, before the model is
    saved, and that end waits for every queued send (its ``__del__`` too); here both leave the
    run to the rank's exit, which :func:`leave` bounds. Failed sends are said (TrackerSends)."""
    if os.environ.get("RANK", "0") != "0":
        return
    logging.getLogger(MLFLOW_QUEUE_LOGGER).addFilter(_SENDS)
    try:
        from transformers.integrations.integration_utils import MLflowCallback
    except ImportError:
        return
    on_train_end, on_del = MLflowCallback.on_train_end, MLflowCallback.__del__

    def deferred_end(self, args, state, control, **kwargs):
        global _MLFLOW_END_DEFERRED
        if not (getattr(self, "_initialized", False) and state.is_world_process_zero and self._auto_end_run):
            return on_train_end(self, args, state, control, **kwargs)
        _MLFLOW_END_DEFERRED = True

    def deferred_del(self):
        if not _MLFLOW_END_DEFERRED:
            on_del(self)

    MLflowCallback.on_train_end, MLflowCallback.__del__ = deferred_end, deferred_del


@record
def main() -> None:
    from llamafactory.train.tuner import run_exp

    # where the time before the first step goes: the display's start-up parts (ui.progress)
    print(f"ftbundle: imported torch, transformers and LlamaFactory in {time.monotonic() - _STARTED:.1f} s",
          flush=True)

    continue_trackers()
    _end_mlflow_at_exit()
    callbacks = [_attempt_fence(), *_step_times(), _tracker_record()]
    credentials = _credentials()
    if credentials:
        import yaml

        with open(sys.argv[1]) as f:
            config = yaml.safe_load(f) or {}
        run_exp(args={**config, **credentials}, callbacks=callbacks)
    else:  # (what `python -m llamafactory.launcher CONFIG` runs under torchrun: run_exp() reads sys.argv)
        run_exp(callbacks=callbacks)


def _ending() -> None:
    """What a finished rank's exit waits for: its MLflow run's end (deferred: _end_mlflow_at_exit),
    then the exit handlers a normal exit runs first (trainer and logger hooks, MLflow's queue,
    W&B's upload, logging.shutdown)."""
    mlflow = sys.modules.get("mlflow")
    if _MLFLOW_END_DEFERRED and mlflow is not None:
        try:
            mlflow.end_run()
        except Exception as exc:  # noqa: BLE001 - the model is saved: said, not raised
            print(f"ftbundle: warning: mlflow could not end its run at {_mlflow_store()}: {type(exc).__name__}: "
                  f"{_why(str(exc))}; every loss is in trainer_log.jsonl", file=sys.stderr, flush=True)
    atexit._run_exitfuncs()


def _answers(url: str) -> str | None:
    """Why an http(s) server does not take a TCP connect in 3 s (None: it does, or not a URL)."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), 3).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except ValueError:
        return None
    return None


def trouble() -> str | None:
    """Evidence that a tracker's server is not taking what rank 0 holds for it: MLflow's failed
    sends, or MLflow's or W&B's (online) server not taking a TCP connect. None: no evidence (a
    long exit is then a healthy upload, W&B's artifacts say, and is not cut)."""
    found = []
    if _MLFLOW_END_DEFERRED:
        store = _mlflow_store()
        down = _answers(store)
        if down or _SENDS.failed:
            failed = f"; {_SENDS.failed} send(s) failed" if _SENDS.failed else ""
            found.append(f"mlflow's server {store} ({down or 'answering now'}{failed}; its run may stay RUNNING there)")
    wandb = sys.modules.get("wandb")
    try:
        run = getattr(wandb, "run", None) if wandb is not None else None
        url = None if run is None or getattr(run, "offline", False) else str(run.settings.base_url or "")
    except Exception:  # noqa: BLE001 - a client's attribute missing in some version: no evidence
        url = None
    down = _answers(url) if url else None
    if down:
        found.append(f"wandb's server {_without_userinfo(url)} ({down}; `wandb sync` the run's directory later)")
    return "; ".join(found) or None


WAIT_SAID_S = 15.0  # a finished rank's exit waiting this long on a tracker in trouble is said


def _exit_guard(code: int, limit: float, done: threading.Event) -> None:
    """Beside a finished rank's exit handlers: where a tracker's server is in trouble (:func:`trouble`)
    the wait is said after WAIT_SAID_S, and at ``limit`` seconds the rank leaves without them,
    said. Without evidence nothing is said or cut, and it is looked at again each ``limit``."""
    rank, started = os.environ.get("RANK", "?"), time.monotonic()
    if done.wait(min(WAIT_SAID_S, limit)):
        return
    if limit > 2 * WAIT_SAID_S:
        said = trouble()
        if said:
            print(f"ftbundle: warning: rank {rank} finished and saved; its exit waits on {said}, {limit:g} s at most "
                  "(FTB_TRACKERS_END_S)", file=sys.stderr, flush=True)
    deadline = started + limit
    while not done.wait(max(0.0, deadline - time.monotonic())):
        said = trouble()
        if said:
            print(f"ftbundle: warning: rank {rank} finished and saved, and waited {time.monotonic() - started:.0f} s "
                  f"(FTB_TRACKERS_END_S) on {said}: it leaves without them; every loss is in trainer_log.jsonl",
                  file=sys.stderr, flush=True)
            os._exit(code)
        deadline += limit


def leave(code: int = 0) -> None:
    """End the process after a successful run without interpreter finalization (see above); its
    exit handlers are bounded where a tracker's server is in trouble (:func:`_exit_guard`)."""
    done = threading.Event()
    threading.Thread(target=_exit_guard, args=(code, trackers_end_s(), done), daemon=True,
                     name="ftbundle-exit-guard").start()
    _ending()
    done.set()
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
