"""What the trackers a LlamaFactory config reports to (``report_to``) need of the hosts, judged
before anything starts. transformers makes each tracker's callback only when the trainer is
made, after the model is loaded and the dataset tokenized (minutes for a large model), and a
tracker that cannot log stops every rank there:

- a tracker none of whose packages the job's interpreter (or image) has
  ("WandbCallback requires wandb to be installed");
- mlflow-skinny (no SQLAlchemy) where rank 0 logs, asked to write a database: the
  MLFLOW_TRACKING_URI the job's env, its env file or the login environment gives, or MLflow's
  own default from 3.7, sqlite:///mlflow.db ("Model registry functionality is unavailable;
  got unsupported URI 'sqlite:///...'");
- MLflow from 3.13 where rank 0 logs, asked for a file store (a ``file:`` URI or a path: the
  usual store of a cluster without an MLflow server; or no URI where ./mlruns in rank 0's working
  directory holds runs, a user's of MLflow before 3.7) without ``MLFLOW_ALLOW_FILE_STORE=true``
  ("The filesystem tracking backend (e.g., './mlruns') is in maintenance mode ...");
- W&B online, or an MLflow tracking server, that rank 0's host does not reach (a TCP connect to
  each place the tracker would log to; none behind a proxy): an air-gapped cluster, or a URI
  naming localhost or the launcher's own address ("Timed out while retrying ... no such host",
  after wandb.init's 90 s);
- W&B online with no key where rank 0 logs ("No API key configured. Use `wandb login` to log
  in."): no WANDB_API_KEY (or identity token) in the job's env, the env file or the login
  environment, no netrc entry for the W&B host, no key in W&B's settings file (the host
  runtime; a container's home is not the host's, and is not judged).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .. import trackers
from ..facts import HostFacts, package_version
from ..layout import Layout
from ..units import release
from .finding import Check, group_by_value, per_hosts

DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow stores that need SQLAlchemy (full mlflow)
FILE_STORE_REFUSED = (3, 13)  # MLflow refuses its file store from here unless MLFLOW_ALLOW_FILE_STORE is true
# W&B's own cloud, as a netrc names it: wandb 0.31's default server is CoreWeave Forge's (its
# `wandb login` writes `machine api.forge.coreweave.com`) and it reads api.wandb.ai's entry too;
# older wandb writes and reads api.wandb.ai (WANDB_BASE_URL names another server)
WANDB_HOSTS = ("api.forge.coreweave.com", "api.wandb.ai")


def check_trackers(facts: list[HostFacts], layout: Layout) -> Check | None:
    """The trackers ``report_to`` names, on the hosts the run would use (None: it names none)."""
    config = layout.lf_config or {}
    names = trackers.reported(config, package_version(facts, "transformers"))
    if not names:
        return None
    probed = trackers.probed(config)
    shown = {f.host: " ".join(f"{d}={v}" for d in probed if (v := (f.versions or {}).get(d, "absent")) != "absent")
             or "none installed" for f in facts}
    check = Check("trackers", group_by_value(shown), label=f"trackers ({', '.join(names)})")
    source = layout.job.train.llamafactory_source or "the LlamaFactory config"
    where = "the image" if layout.docker else layout.python or "python3"
    every = "all" in names  # (every tracker installed is used; no report_to on transformers 4 too)
    missing = [(f.host, name, lambda hosts, name=name, dists=dists: f"{name} (report_to in {source}) is not installed "
                f"in {where} on {hosts}" + (f": none of {', '.join(dists)}" if len(dists) > 1 else ""))
               for f in facts for name, dists in trackers.packages(config).items()
               if all((f.versions or {}).get(d) == "absent" for d in dists)]
    if missing:
        check.failure = "tracker not installed"
        check.details += per_hosts(missing) + [
            f"(the trainer imports each tracker once the model is loaded: install it in {where}, or take it "
            "out of report_to)"]
    env = layout.job.env
    rank0 = next((f for f in facts if f.rank == 0), None)
    if ("mlflow" in names or every) and rank0 is not None:  # (rank 0 alone logs; its URI: the job's, else its own)
        uri = env.get("MLFLOW_TRACKING_URI") or rank0.env.get("MLFLOW_TRACKING_URI")
        store = uri or rank0.mlruns  # (no URI, ./mlruns holding runs: MLflow's default is that file store)
        line = skinny_store(rank0, store)
        if line:
            check.failure = check.failure or "tracker cannot log"
            check.details += [line, "(set MLFLOW_TRACKING_URI in the job's env to your MLflow server, or install "
                                    "mlflow beside it)"]
        line = file_store(rank0, store,
                          env.get("MLFLOW_ALLOW_FILE_STORE", rank0.env.get("MLFLOW_ALLOW_FILE_STORE")),
                          default=not uri)
        if line:
            check.failure = check.failure or "tracker cannot log"
            check.details += [line, "(set MLFLOW_ALLOW_FILE_STORE: \"true\" in the job's env to keep the file store, "
                                    "or MLFLOW_TRACKING_URI to your MLflow server)"]
    keyless = None
    if ("wandb" in names or every) and rank0 is not None and rank0.wandb_login is not None:
        keyless = wandb_without_key(rank0, env, installed=(rank0.versions or {}).get("wandb") not in (None, "absent"))
        if keyless:
            check.failure = check.failure or "tracker cannot log"
            check.details += [keyless, "(`wandb login` there as the user the job runs as, or set WANDB_API_KEY in the "
                                       "job's env or its env file; WANDB_MODE: offline keeps the run in the run "
                                       "directory for `wandb sync`)"]
    for name, hint in (("wandb", "(WANDB_MODE: offline in the job's env keeps the run in the run directory, for "
                                 "`wandb sync` from a host that reaches W&B; behind a proxy, set HTTPS_PROXY in the "
                                 "job's env)"),
                       ("mlflow", "(set MLFLOW_TRACKING_URI in the job's env to an address rank 0's host reaches: "
                                  "localhost there is not the launcher's)")):
        line = unreachable(rank0, name, env) if rank0 is not None and (name in names or every) else None
        if line and not (name == "wandb" and keyless):
            check.failure = check.failure or "tracker cannot log"
            check.details += [line, hint]
    return check


WAITS = {"wandb": "wandb.init gives up after its init_timeout (90 s), once the model is loaded",
         "mlflow": "MLflow's first call fails after its retries (4 min against a closed port), once the model "
                   "is loaded"}


def unreachable(rank0: HostFacts, name: str, job_env: dict[str, str]) -> str | None:
    """The line naming rank 0's host when none of the places its tracker ``name`` would log to
    answered its probe's TCP connect (None: one did, or it was not asked: offline, a proxy, a
    store that is not a server, a tracker not installed). The job's WANDB_MODE wins over the
    host's, as in the ranks' environment."""
    places = (rank0.servers or {}).get(name)
    versions = rank0.versions or {}
    if not isinstance(places, dict) or not places or "ok" in places.values():
        return None
    if all(versions.get(d) in (None, "absent") for d in trackers.PACKAGES[name]):
        return None  # (not installed: said above where report_to names it; "all" does not use it)
    mode = job_env.get("WANDB_MODE", rank0.env.get("WANDB_MODE"))
    if name == "wandb" and str(mode or "").lower() in trackers.WANDB_OFF:
        return None
    said = ", ".join(f"{where} {why}" for where, why in sorted(places.items()))
    server = "its server" if name == "wandb" else "its tracking server"
    return f"{name} (report_to) cannot reach {server} from {rank0.host}, where rank 0 logs: {said}: {WAITS[name]}"


def skinny_store(rank0: HostFacts, uri: str | None) -> str | None:
    """The line naming rank 0's host when its MLflow would come from mlflow-skinny alone (no
    SQLAlchemy) and be asked to write a database: the store the job names, or MLflow's own
    default from 3.7 (sqlite:///mlflow.db). The first log fails there, after the model is loaded."""
    versions = rank0.versions or {}
    skinny = versions.get("mlflow-skinny")
    if versions.get("mlflow") != "absent" or skinny in (None, "absent"):
        return None
    default = not uri and release(skinny)[:2] >= trackers.MLFLOW_SQLITE_DEFAULT
    if not default and (uri or "").split(":", 1)[0].split("+", 1)[0].lower() not in DATABASES:
        return None
    store = "sqlite:///mlflow.db (MLflow's default store)" if default else uri
    return (f"mlflow-skinny {skinny} on {rank0.host} cannot write {store}: a database store needs the full mlflow "
            "package (SQLAlchemy)")


def file_store(rank0: HostFacts, uri: str | None, allowed: str | None, default: bool = False) -> str | None:
    """The line naming rank 0's host when its MLflow (3.13 or later) would be asked for a file
    store (a ``file:`` URI or a path; ``default``: no URI is set, and ./mlruns in rank 0's working
    directory holds runs, so MLflow's default is that) with MLFLOW_ALLOW_FILE_STORE not true
    (None: it would log)."""
    versions = rank0.versions or {}
    version = next((v for v in (versions.get("mlflow"), versions.get("mlflow-skinny")) if v not in (None, "absent")),
                   None)
    if version is None or release(version)[:2] < FILE_STORE_REFUSED or not uri:
        return None
    if not (uri.lower().startswith("file:") or uri.startswith(("/", "./", "../", "~"))):
        return None
    if str(allowed or "").strip().lower() in ("true", "1"):
        return None
    store = f"{uri} (MLflow's default with no MLFLOW_TRACKING_URI: it holds runs already)" if default else uri
    return (f"mlflow {version} on {rank0.host} refuses the file store {store} unless MLFLOW_ALLOW_FILE_STORE is true "
            "(from MLflow 3.13: 'The filesystem tracking backend ... is in maintenance mode'): the first log would "
            "stop the run once the model is loaded")


def wandb_without_key(rank0: HostFacts, job_env: dict[str, str], installed: bool) -> str | None:
    """The line naming rank 0's host when its wandb.init would find no key (None: it would, or
    it needs none). The job's env wins over the env file's and the login's (rank0.env: the
    probe's view, a key's value masked); a netrc ``default`` entry or any entry where
    WANDB_BASE_URL, or W&B's settings file, names another server counts (no false alarm on a
    server this does not know)."""
    if not installed:
        return None  # (said above, where report_to names it; with "all" it is not used)
    env = {**rank0.env, **{k: str(v) for k, v in job_env.items()}}
    login = rank0.wandb_login or {}
    mode = env.get("WANDB_MODE") or login.get("workspace_mode")  # (`wandb offline` in the workdir: its settings)
    if (str(mode or "").lower() in trackers.WANDB_OFF or env.get("WANDB_API_KEY")
            or env.get("WANDB_IDENTITY_TOKEN_FILE") or env.get("WANDB_ANONYMOUS")
            or str(env.get("WANDB_DISABLED", "")).lower() in ("true", "1", "yes")):
        return None
    machines = login.get("machines") or []
    # (`wandb login --host` writes the server to W&B's settings file; the workdir's settings may name one too)
    other = env.get("WANDB_BASE_URL") or login.get("workspace_base_url") or login.get("settings_base_url")
    servers = (urlsplit(other).netloc,) if other else WANDB_HOSTS
    if "default" in machines or set(servers) & set(machines) or (other and machines) or login.get("settings_key"):
        return None
    netrc = login.get("netrc") or "~/.netrc"
    said = (f"{netrc} has no entry for {' or '.join(servers)}" if login.get("machines") is not None else
            f"no {netrc}")
    return (f"wandb (report_to) has no API key on {rank0.host}, where rank 0 logs: no WANDB_API_KEY in the job's env, "
            f"its env file or the login environment, {said}, and WANDB_MODE is not offline: wandb.init would stop "
            "the run once the model is loaded ('No API key configured')")
