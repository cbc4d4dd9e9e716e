"""Experiment trackers (issue 47 item 4): the run's id and the job's name reach LlamaFactory's
``report_to`` trackers, and the run says where its tracker is. Pure.

- every tracker: ``run_name`` is the run id unless the config names one (transformers passes it
  to TensorBoard's, W&B's and MLflow's callbacks as the run's name);
- TensorBoard: its directory under the run directory on shared storage
  (``<run_dir>/tensorboard``) unless the config or the job names one, so `tensorboard --logdir
  <shared_dir>/runs` shows every run. transformers 5 reads it from ``TENSORBOARD_LOGGING_DIR``
  alone (its ``logging_dir`` argument is deprecated, warned of, and not used: the events went to
  ``<output_dir>/runs/<date>_<host>``, found by a real run in tests/train/test_quickstart.py);
  transformers 4 from ``logging_dir`` alone: the variable is set for every rank, the argument
  only where the hosts run transformers 4;
- W&B: ``WANDB_TAGS`` (ftbundle, the job's name), ``WANDB_RUN_GROUP`` (the job's name) and
  ``WANDB_DIR`` (the run directory: W&B's own files, and with ``WANDB_MODE=offline`` the whole
  run, are kept with the run's logs on shared storage, where ``wandb sync`` finds them);
  MLflow: ``MLFLOW_TAGS`` (the job and the run): each unless the job's env sets it. MLflow's
  store is the user's (``MLFLOW_TRACKING_URI``, a tracking server as a rule); without one it is
  MLflow's default, said as it is: ``sqlite:///mlflow.db`` in rank 0's working directory from
  MLflow 3.7 (``./mlruns`` before, or where that already holds runs).

Once training has begun, rank 0 keeps the MLflow and W&B runs it logs to in the run directory
(``trackers.json``, shims/llamafactory_entry.py); :func:`placed` says them. A later attempt of the
run continues those runs (the entry sets MLFLOW_RUN_ID, WANDB_RUN_ID with WANDB_RESUME=allow), and
so does a run that resumes another's checkpoint (:func:`continued`: that run's record is staged).

Each tracker is a package the ranks import only once the model is loaded and the dataset
tokenized: :func:`packages` names what the check looks for on every host first
(ftbundle/check/tracker_rules.py).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from .rundir import TENSORBOARD
from .units import release

TB_VARIABLE = "TENSORBOARD_LOGGING_DIR"  # where transformers 5's TensorBoard callback writes
KNOWN = ("tensorboard", "wandb", "mlflow", "comet_ml", "clearml", "swanlab", "trackio", "dvclive", "neptune")
# the distributions that give transformers each tracker (any one of them will do), as installed
PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow", "mlflow-skinny"),
            "comet_ml": ("comet_ml",), "clearml": ("clearml",), "swanlab": ("swanlab",), "trackio": ("trackio",),
            "dvclive": ("dvclive",), "neptune": ("neptune", "neptune-client")}
MLFLOW_SQLITE_DEFAULT = (3, 7)  # MLflow's default store became sqlite:///mlflow.db (./mlruns before)


def reported(config: dict[str, Any], transformers: str | None = None) -> list[str]:
    """The trackers the config reports to (transformers' ``report_to``: a name, a list,
    "none", or "all": every one installed, which only the ranks know). Not set: transformers 4
    reports to "all" (5 to none), so with ``transformers`` (the hosts' version) 4.x it is "all"."""
    value = config.get("report_to")
    if value is None:
        return ["all"] if release(transformers)[:1] == (4,) else []
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    names = [str(n).strip().lower() for n in names]
    return [] if names in ([], ["none"]) else names


def packages(config: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """The trackers ``report_to`` names that the ranks will import, each with the packages that
    give it (``"all"``: whatever is installed, nothing is needed)."""
    return {n: PACKAGES[n] for n in reported(config) if n in PACKAGES}


def maybe_every(config: dict[str, Any]) -> bool:
    """Every installed tracker may be used: ``"all"``, or no ``report_to`` (transformers 4's
    default, the hosts' version not known before the check)."""
    return config.get("report_to") is None or "all" in reported(config)


def probed(config: dict[str, Any]) -> list[str]:
    """The packages the check asks the hosts for: those of :func:`packages`, and where every
    installed tracker may be used (:func:`maybe_every`) every tracker's."""
    chosen = PACKAGES if maybe_every(config) else packages(config)
    return [d for dists in chosen.values() for d in dists]


def installed(versions: dict[str, str] | None) -> frozenset[str] | None:
    """The trackers whose packages these versions (a host's, as its probe found them) hold;
    None: not asked (the probe asks for every tracker's packages where "all" may be used). Pure."""
    if not versions or not all(d in versions for dists in PACKAGES.values() for d in dists):
        return None
    return frozenset(n for n, dists in PACKAGES.items() if any(versions.get(d) not in (None, "absent") for d in dists))


def staged(config: dict[str, Any], *, run_dir: str, run_id: str, job: str, env: dict[str, str],
           workdir: str = ".", transformers: str | None = None, mlflow: str | None = None,
           present: frozenset[str] | None = None, rank0_mlflow: tuple[str | None, str | None] = (None, None)
           ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(config keys to stage, environment for the ranks, where each tracker is: said by `runs`).
    ``transformers``, ``mlflow``: the versions the hosts' ranks run (None: not known);
    ``workdir``: the ranks' working directory; ``present``: the trackers installed where rank 0
    logs (:func:`installed`; "all" uses those alone; None: not known, each is said);
    ``rank0_mlflow``: its host's MLFLOW_TRACKING_URI (env file or login, without user and password)
    and its ./mlruns where that holds runs (the probe's; MLflow's default is then that store)."""
    names = reported(config, transformers)
    if not names:
        return {}, {}, []
    if "all" in names and present is not None:  # (every installed one: those rank 0 has)
        names = [n for n in KNOWN if n in present]
        if not names:
            return {}, {}, []
    every = "all" in names
    keys: dict[str, Any] = {}
    extra: dict[str, str] = {}
    where: list[str] = []
    name = config.get("run_name") or run_id
    if not config.get("run_name"):
        keys["run_name"] = run_id
    if every or "tensorboard" in names:
        logdir = env.get(TB_VARIABLE) or config.get("logging_dir") or posixpath.join(run_dir, TENSORBOARD)
        if TB_VARIABLE not in env:
            extra[TB_VARIABLE] = logdir
        if not config.get("logging_dir") and release(transformers)[:1] == (4,):
            keys["logging_dir"] = logdir
        where.append(f"tensorboard {logdir}")
    if every or "wandb" in names:
        if "WANDB_TAGS" not in env:
            extra["WANDB_TAGS"] = f"ftbundle,{job}"
        if "WANDB_RUN_GROUP" not in env:
            extra["WANDB_RUN_GROUP"] = job
        # (the job's env wins in the ranks' environment, an empty WANDB_DIR too: W&B's default, cwd)
        wandb_dir = (env["WANDB_DIR"] or workdir) if "WANDB_DIR" in env else run_dir
        if "WANDB_DIR" not in env:
            extra["WANDB_DIR"] = run_dir
        project = env.get("WANDB_PROJECT", "llamafactory")  # (LlamaFactory's ReporterCallback sets this default)
        where.append(f"wandb offline run {name!r} in {posixpath.join(wandb_dir, 'wandb')} (`wandb sync` it)"
                     if str(env.get("WANDB_MODE", "")).lower() == "offline" else
                     f"wandb run {name!r} in project {project}")
    if every or "mlflow" in names:
        if "MLFLOW_TAGS" not in env:
            extra["MLFLOW_TAGS"] = json.dumps({"ftbundle.job": job, "ftbundle.run": run_id})
        host_uri, mlruns = rank0_mlflow
        where.append(f"mlflow run {name!r} at " + (env.get("MLFLOW_TRACKING_URI") or host_uri or (
            f"{mlruns} (MLflow's default: it holds runs already)" if mlruns else mlflow_default(workdir, mlflow))))
    where += [f"{n} run {name!r}" for n in names if n not in ("all", "tensorboard", "wandb", "mlflow")]
    return keys, extra, where


def placed(said: list[str], kept: dict[str, Any] | None) -> list[str]:
    """Where each tracker is: the plan's lines (:func:`staged`), MLflow's and W&B's replaced by
    the runs rank 0 logs to, once it has kept them (``trackers.json``: its MLflow run's id,
    experiment and store, its W&B run's id and URL or offline directories, the attempts that
    logged to them). Pure."""
    kept = kept if isinstance(kept, dict) else {}
    attempts = f", continued from run {kept['from_run']}" if kept.get("from_run") else ""
    if str(kept.get("began", "")).isdigit() and str(kept.get("attempt", "")).isdigit() \
            and int(kept["attempt"]) > int(kept["began"]):
        attempts += f", attempts {kept['began']}-{kept['attempt']}"
    runs = {}
    mlflow = kept.get("mlflow") if isinstance(kept.get("mlflow"), dict) else {}
    if mlflow.get("run_id"):
        runs["mlflow"] = (f"mlflow run {mlflow.get('name')!r} (id {mlflow['run_id']}, experiment "
                          f"{mlflow.get('experiment_id')}{attempts}) at {mlflow.get('tracking_uri')}")
    wandb = kept.get("wandb") if isinstance(kept.get("wandb"), dict) else {}
    if wandb.get("id"):
        dirs = [str(d) for d in kept.get("wandb_dirs") or [] if d]
        runs["wandb"] = (f"wandb offline run {wandb.get('name')!r} (id {wandb['id']}{attempts}): `wandb sync "
                         f"{' '.join(dirs)}`" if wandb.get("offline") and dirs else
                         f"wandb run {wandb.get('name')!r} (id {wandb['id']}{attempts}) "
                         + (str(wandb["url"]) if wandb.get("url") else f"in project {wandb.get('project')}"))
    return [runs.get(line.split(" ", 1)[0], line) for line in said]


def continued(kept: dict[str, Any] | None, run_id: str) -> dict[str, Any] | None:
    """What a run that resumes run ``run_id``'s checkpoint stages as its own trackers.json, so
    that its rank 0 logs on into that run's MLflow and W&B runs (None: it kept none). Pure."""
    kept = kept if isinstance(kept, dict) else {}
    runs = {k: kept[k] for k in ("mlflow", "wandb") if isinstance(kept.get(k), dict)}
    if not runs:
        return None
    return {"from_run": run_id, **runs, "wandb_dirs": [str(d) for d in kept.get("wandb_dirs") or [] if d]}


def continuing(record: dict[str, Any]) -> str:
    """`trackers: continuing run R's mlflow run X and wandb run Y`, said before launch. Pure."""
    runs = [f"mlflow run {record['mlflow'].get('run_id')}" if "mlflow" in record else "",
            f"wandb run {record['wandb'].get('id')}" if "wandb" in record else ""]
    return (f"trackers: continuing run {record['from_run']}'s {' and '.join(r for r in runs if r)} (its checkpoint's; "
            "a fresh output_dir begins new ones)")


PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")  # (the probe has its own)
WANDB_OFF = ("offline", "dryrun", "disabled")  # WANDB_MODE values that need no key and no server


def _public(url: str | None) -> str | None:
    """An http(s) URL's scheme, host and port alone (no user, password or path: it travels in
    the probe's argv); None for any other store (file:, databricks, sqlite:, ...)."""
    scheme, sep, rest = (url or "").partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None
    return f"{scheme.lower()}://{rest.split('/', 1)[0].rpartition('@')[2]}"


def servers_asked(config: dict[str, Any], env: dict[str, str]) -> dict[str, Any] | None:
    """What rank 0's probe is asked to reach (remote/probe.py ``servers``): W&B's server unless
    the job's env runs it offline, MLflow's tracking server; the job's own URLs (its host's
    decide where it sets none), and whether it sets a proxy. None: no tracker that needs one."""
    every, names = maybe_every(config), reported(config)
    asked: dict[str, Any] = {}
    if (every or "wandb" in names) and str(env.get("WANDB_MODE") or "").lower() not in WANDB_OFF:
        asked["wandb"] = {"url": _public(env.get("WANDB_BASE_URL")), "mode": env.get("WANDB_MODE")}
    if every or "mlflow" in names:
        asked["mlflow"] = {"set": bool(env.get("MLFLOW_TRACKING_URI")), "url": _public(env.get("MLFLOW_TRACKING_URI"))}
    if asked and any(env.get(n) for n in PROXIES):
        asked["proxies"] = [n for n in PROXIES if env.get(n)]
    return asked or None


def mlflow_default(workdir: str, version: str | None) -> str:
    """Where MLflow keeps a run when no tracking URI is given: in the working directory of the
    rank that logs (rank 0), a SQLite file from MLflow 3.7, ./mlruns before (and after, where
    ./mlruns already holds runs)."""
    if version is not None and release(version)[:2] < MLFLOW_SQLITE_DEFAULT:
        return f"{posixpath.join(workdir, 'mlruns')} (MLflow's default, in rank 0's working directory)"
    return (f"sqlite:///{posixpath.join(workdir, 'mlflow.db')} (MLflow's default from 3.7, in rank 0's "
            "working directory; ./mlruns there instead where that holds runs already)")
