"""What rank 0's trackers need of its host (spec "trackers", "wandb_login", "servers"): the
variables wandb.init and MLflow read, where W&B would find a key, and whether the trackers'
servers answer. The check judges them (ftbundle/check/tracker_rules.py).

A part of the probe (shipped before ftbundle/remote/probe.py: ``probe_source``), standard
library only. A key's value and a URI's user and password never leave the host.
"""

import os
import time

if __package__:  # imported (tests); shipped, the texts of these come before this one
    from .probe_common import Task, knocked

# ... and where rank 0 logs to trackers (spec "trackers"): what wandb.init and MLflow read (a key's
# value, a URI's user and password, never leave the host)
PROXY_NAMES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")  # (trackers.PROXIES)
TRACKER_NAMES = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_ANONYMOUS",
                 "WANDB_BASE_URL", "NETRC", "WANDB_CONFIG_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE",
                 *PROXY_NAMES)
WANDB_CLOUD = ("https://api.forge.coreweave.com", "https://api.wandb.ai")  # (wandb 0.31's default; older wandb's)
REACH_S = 3  # a tracker's server not answering a TCP connect in this long is not reachable


def endpoint(url):
    """("host", port) of an http(s) URL (None: another kind of store, or not a URL)."""
    scheme, sep, rest = (url or "").partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None
    netloc = rest.split("/", 1)[0].rpartition("@")[2]
    host, colon, port = netloc.rpartition(":") if not netloc.endswith("]") else (netloc, "", "")
    if not colon or not port.isdigit():
        host, port = netloc, "443" if scheme.lower() == "https" else "80"
    return (host.strip("[]"), int(port)) if host else None


def servers(asked, view, settings_base_url=None, workspace=None):
    """Whether rank 0's host reaches the servers its trackers log to, by a TCP connect of at most
    REACH_S each, all at once: W&B's (the job's WANDB_BASE_URL, else this host's, else the one
    its workspace's or its settings file names, else W&B's cloud under both its names) unless W&B
    runs offline (WANDB_MODE, else the workspace's mode: `wandb offline` in the workdir);
    MLflow's (an http(s) MLFLOW_TRACKING_URI, the job's else this host's). Behind a proxy the
    trackers go through it: said, not tried. {"wandb": {"host:port": "ok" or why}, ...}"""
    proxy = next((n for n in PROXY_NAMES if n in asked.get("proxies", ()) or view.get(n)), None)
    if proxy:
        return {"proxy": proxy}
    targets = {}
    wandb, workspace = asked.get("wandb"), workspace or {}
    if wandb is not None and str(wandb.get("mode") or view.get("WANDB_MODE") or workspace.get("mode") or "").lower(
            ) not in ("offline", "dryrun", "disabled"):
        url = wandb.get("url") or view.get("WANDB_BASE_URL") or workspace.get("base_url") or settings_base_url
        urls = [url] if url else list(WANDB_CLOUD)
        targets["wandb"] = [e for e in map(endpoint, urls) if e]
    mlflow = asked.get("mlflow")
    if mlflow is not None:
        url = mlflow.get("url") if mlflow.get("set") else view.get("MLFLOW_TRACKING_URI")
        targets["mlflow"] = [e for e in [endpoint(url)] if e]
    found = {}

    def knock(name, where):
        found[name][f"{where[0]}:{where[1]}"] = knocked(where[0], where[1], REACH_S)

    tasks, end = [], time.monotonic() + REACH_S + 1  # (a name lookup may hang past the connect's limit)
    for name, places in targets.items():
        found[name] = {f"{h}:{p}": f"no answer in {REACH_S + 1:g} s" for h, p in places}  # (until it answers)
        tasks += [Task(knock, (name, where), "reach").start() for where in places]
    for t in tasks:
        t.join(max(0.0, end - time.monotonic()))
    return {name: dict(places) for name, places in found.items() if places}


def masked(name, value):
    """A variable's value as the probe may say it: a key as "(set)", a URI without its user."""
    if name == "WANDB_API_KEY":
        return "(set)"
    scheme, sep, rest = value.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://{rest.split('@', 1)[1]}"
    return value


def _pairs(path):
    """A W&B settings file's `key = value` lines (its sections ignored); OSError when unread."""
    with open(path, errors="replace") as f:
        return [[part.strip() for part in line.split("=", 1)] for line in f if "=" in line]


def wandb_workspace(workdir):
    """What the W&B settings file of the ranks' working directory says (``wandb offline``, ``wandb
    online``, ``wandb init`` write it there: ./wandb/settings, ./.wandb/settings where that folder
    is): wandb.init reads it from its working directory whatever WANDB_DIR is, and the environment
    wins over it. {"path", "mode", "base_url"} as it names them; {} where there is none."""
    if not workdir:
        return {}
    path = os.path.join(workdir, ".wandb" if os.path.isdir(os.path.join(workdir, ".wandb")) else "wandb", "settings")
    try:
        pairs = _pairs(path)
    except OSError:
        return {}
    return {"path": path, **{key: value for key, value in pairs if key in ("mode", "base_url") and value}}


def wandb_login(view, workspace=None):
    """Where wandb.init would look for a key besides the environment (wandb/sdk/lib/wbauth):
    the netrc file ($NETRC, else ~/.netrc, else ~/_netrc) by its machine names (a `default`
    entry said as such; no password is read out), and W&B's settings file by whether it names
    an api_key, and the server it names (`wandb login --host URL` writes its base_url there and
    that server's netrc entry); and what the workdir's settings say (``workspace``:
    :func:`wandb_workspace`). The check decides (check/tracker_rules.py)."""
    home = os.path.expanduser("~")
    netrc = view.get("NETRC") or next((p for p in (os.path.join(home, ".netrc"), os.path.join(home, "_netrc"))
                                       if os.path.exists(p)), os.path.join(home, ".netrc"))
    found = {"netrc": os.path.expanduser(netrc), "machines": None, "settings_key": False}
    try:
        with open(found["netrc"], errors="replace") as f:
            words = f.read().split()
        found["machines"] = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "machine"]
        found["machines"] += ["default"] * ("default" in words)
    except OSError as exc:
        found["netrc_error"] = exc.strerror
    settings = os.path.join(view.get("WANDB_CONFIG_DIR") or os.path.join(home, ".config", "wandb"), "settings")
    found.update({f"workspace_{key}": value for key, value in (workspace or {}).items()})
    try:
        pairs = _pairs(settings)
        found["settings_key"] = any(key == "api_key" for key, _ in pairs)
        found["settings_base_url"] = next((value for key, value in pairs if key == "base_url" and value), None)
    except OSError:
        pass
    return found


def mlruns(asked, view, workdir):
    """Where rank 0's MLflow keeps its runs by default when it holds runs there already: the job
    and this host name no MLFLOW_TRACKING_URI, and ./mlruns in the ranks' working directory holds
    a numbered experiment directory with its meta.yaml (MLflow's own test: then its default is that
    file store, not its SQLite file). The path, else None."""
    if (asked.get("mlflow") or {}).get("set", True) or view.get("MLFLOW_TRACKING_URI") or not workdir:
        return None
    path = os.path.join(workdir, "mlruns")
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.isdigit() and entry.is_dir() and os.path.lexists(os.path.join(entry.path, "meta.yaml")):
                    return path
    except OSError:
        return None
    return None
