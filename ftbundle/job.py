"""The job file: its schema, its validation, and nothing else.

``load_job(path)`` turns a job.yaml into a typed :class:`Job` or raises
:class:`~ftbundle.errors.UserError` naming the file, the key (with its line) and what
would be valid. Paths in the job file are relative to the job file's directory, the way
docker-compose reads its file, so a job can be launched from anywhere.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit
from pathlib import Path
from typing import Any

import yaml

from . import userfiles
from .errors import UserError, did_you_mean, show
from .notify import Notify, shown

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names whose values never reach a terminal, a log or the plan file.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
# Shorter values are not masked in output: "1" or "abc" would blank out unrelated text.
MIN_SECRET_LEN = 4
MIN_STALL_TIMEOUT_S = 5  # progress is sampled every second below 60 s; a shorter limit would mistake a pause for a stall
DEFAULT_NCCL_ENV_FILE = "/etc/ftbundle/nccl.env"
ENV_ENTRY_MAX = 131_072  # bytes of one NAME=value with its NUL: Linux's MAX_ARG_STRLEN (32 pages)
ENV_TOTAL_MAX = 1_048_576  # the job's env in all: half of the usual 2 MiB ARG_MAX, the rest for the host's
# repo@sha256:<digest> (pulled from a registry), or an image ID (loaded from a tarball):
# either names exactly one image's bytes, whatever a tag points to today.
PINNED_IMAGE_RE = re.compile(r"(@|^)sha256:[0-9a-f]{64}$")


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


# a URL's password (scheme://user:password@host): a tracking server's, a proxy's, a database's
URL_PASSWORD_RE = re.compile(r"\b[A-Za-z][\w+.-]*://[^/?#@\s:]*:([^/?#@\s]+)@")


def holds_secret(name: str, value: str) -> bool:
    """A secret variable by its name, or one whose URL value holds a password (an exported job
    takes it from the submitting environment or a Kubernetes Secret, not from the file)."""
    return is_secret(name) or bool(url_passwords({name: value}))


def url_passwords(env: dict[str, str]) -> list[str]:
    """The passwords in an environment's URL values (MLFLOW_TRACKING_URI, HTTPS_PROXY, ...):
    secrets whatever the variable's name, masked as a secret variable's value is."""
    return sorted({m.group(1) for value in env.values() for m in URL_PASSWORD_RE.finditer(str(value))
                   if len(m.group(1)) >= MIN_SECRET_LEN})


@dataclass(frozen=True)
class Runtime:
    """Where the ranks' processes run: this interpreter on the host, or a pinned image."""

    kind: str = "host"  # host | docker
    python: str = "python3"  # host: the interpreter (its bin/ goes first on PATH); docker: inside the image
    image: str | None = None  # docker: repo@sha256:..., default: the inventory's ftb_image
    gpus: str | None = None  # docker: value of `docker run --gpus`, e.g. "all"; None: no GPUs
    docker_args: tuple[str, ...] = ()  # docker: extra `docker run` arguments
    env_file: str | None = DEFAULT_NCCL_ENV_FILE  # written by the nccl role on every host


@dataclass(frozen=True)
class Train:
    """Exactly one of: a LlamaFactory config, a user script under torchrun, a per-node command."""

    mode: str  # llamafactory | script | command
    llamafactory: dict[str, Any] | None = None  # the config, loaded (path configs are read here)
    llamafactory_source: str | None = None  # where it came from, for messages
    # The config's `deepspeed:` JSON when it is a file beside the config on this machine:
    # staged into the run directory with the config, so the hosts need no copy of it.
    deepspeed_json: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()
    command: str | None = None


@dataclass(frozen=True)
class Job:
    name: str
    path: Path  # the job file
    train: Train = field(repr=False)  # a LlamaFactory config may hold credentials
    inventory: Path | None = None
    hosts: str = "all"
    nproc_per_node: int | str = 1  # int >= 1, or "auto"
    # int >= 0, or "auto": `run` uses the GPUs the job sees; an export requests nproc_per_node
    # GPUs per node unless the job is a CPU job (see ftbundle.export.gpus_per_node)
    gpus_per_node: int | str = "auto"
    master_port: int = 29500
    shared_dir: str | None = None  # as written; relative paths only make sense for local-only jobs
    workdir: str | None = None  # as written; default: shared_dir (remote hosts) or the job's dir (local)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    runtime: Runtime = field(default_factory=Runtime)
    restarts: int = 0
    check: bool = True
    stall_timeout: int = 600  # seconds without progress before a run is diagnosed and stopped; 0: never
    health: str = "refuse"  # GPU health in the check: refuse (a sick GPU stops the run) | warn | off
    # a node whose median step time is above this x the fleet's median is named a straggler (ui.stragglers)
    straggler_factor: float = 1.15
    # a run whose loss went nan or whose model collapsed (shims/steptimes.py LossWatch): stop | warn
    divergence: str = "stop"
    # a host lost for good (ftbundle.launch.attempts): stop | exclude (the next attempt runs on
    # the hosts left) | spare (a host of the `spares` group takes its place, else exclude)
    on_node_loss: str = "stop"
    spares: str = "spares"  # the inventory group spares come from
    min_nodes: int = 1  # fewer hosts left than this: the run stops (exit 255)
    keep_global_batch: bool = True  # LlamaFactory: gradient_accumulation_steps rescaled to the new world
    tokenize_once: bool = True  # LlamaFactory: the tokenized dataset kept on shared storage (ftbundle/tokenized.py)
    notify: Notify | None = None  # a webhook and/or a command told when the run ends (ftbundle/notify.py)
    # copied to every host's stage_dir before the ranks start (ftbundle/stage.py): "model", "dataset", paths
    stage: tuple[str, ...] = ()
    stage_dir: str = "/var/cache/ftbundle"
    # each host's stage_dir pruned of entries unused this long / beyond this size (ftbundle/stage.py)
    stage_keep: dict = field(default_factory=lambda: {"days": 30, "bytes": None})

    @property
    def base_dir(self) -> Path:
        return self.path.parent


# ---------------------------------------------------------------------------------------
# Loading


def _notify(r, raw) -> Notify | None:
    """``notify: {webhook: URL, command: CMD}``, either or both."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw:
        raise r.error("notify", f"must be a mapping with webhook: URL and/or command: CMD, got {show(raw)}")
    r.check_keys(raw, {"webhook", "command"}, "notify.")
    webhook = r.string(raw, "webhook", "notify.webhook")
    command = r.string(raw, "command", "notify.command")
    if webhook is not None:
        parts = urlsplit(webhook)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise r.error("notify.webhook", f"must be an http:// or https:// URL, got {shown(webhook)!r}")
    if command is not None and not command.strip():
        raise r.error("notify.command", "is empty: a shell command, run with summary.json on its stdin")
    return Notify(webhook=webhook, command=command)

def _stage(r, data) -> tuple[tuple[str, ...], str, dict]:
    """``stage: [model, dataset, PATH, HOST:PATH]``, ``stage_dir`` (an absolute path) and
    ``stage_keep: {days: N, size_gb: G}`` (entries unused N days are removed, and the least
    recently used while all hold more than G GB; either may be null: no limit)."""
    raw = data.get("stage") or []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(v, str) and v.strip() for v in raw):
        raise r.error("stage", "must be a list of what to copy to every host before the ranks start: model, dataset "
                               f"(the LlamaFactory config's), a path, or HOST:PATH; got {show(data.get('stage'))}")
    stage_dir = r.string(data, "stage_dir", "stage_dir", "/var/cache/ftbundle")
    if not str(stage_dir).startswith("/") or str(stage_dir).rstrip("/") == "":
        raise r.error("stage_dir", f"must be an absolute directory on every host's own disk, got {show(stage_dir)}")
    keep_raw = data.get("stage_keep", {"days": 30})
    if not isinstance(keep_raw, dict):
        raise r.error("stage_keep", f"must be a mapping {{days: N, size_gb: G}} (either null: no limit), got "
                                    f"{show(keep_raw)}")
    r.check_keys(keep_raw, {"days", "size_gb"}, "stage_keep.")
    keep = {}
    for key, name in (("days", "days"), ("size_gb", "bytes")):
        value = keep_raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise r.error(f"stage_keep.{key}", f"must be a positive number or null (no limit), got {show(value)}")
        keep[name] = None if value is None else (float(value) if key == "days" else int(value * 1e9))
    return tuple(v.strip() for v in raw), posixpath.normpath(stage_dir), keep


_TOP_KEYS = {
    "name", "inventory", "hosts", "nproc_per_node", "gpus_per_node", "master_port", "shared_dir", "workdir",
    "env", "runtime", "train", "restarts", "check", "stall_timeout", "health", "straggler_factor",
    "divergence", "on_node_loss", "spares", "min_nodes", "keep_global_batch", "tokenize_once", "notify", "stage", "stage_dir",
    "stage_keep",
}
HEALTH_MODES = ("refuse", "warn", "off")
DIVERGENCE_MODES = ("stop", "warn")
NODE_LOSS_POLICIES = ("stop", "exclude", "spare")
_RUNTIME_KEYS = {"kind", "python", "image", "gpus", "docker_args", "env_file"}
_TRAIN_KEYS = {"llamafactory", "script", "args", "command", "deepspeed"}


def _line_map(text: str) -> dict[str, int]:
    """Dotted key path -> 1-based line, so type errors can say where they are."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    try:
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, "")
    return lines


class _Reader:
    """Typed access to a parsed mapping that raises UserError with file, key and line."""

    def __init__(self, file: Path, lines: dict[str, int]):
        self.file = file
        self.lines = lines

    def error(self, key: str, message: str) -> UserError:
        line = self.lines.get(key)
        file = f"{self.file}:{line}" if line else str(self.file)
        return UserError(message, file=file, key=key)

    def check_keys(self, data: dict, allowed: set[str], prefix: str) -> None:
        for key in data:
            if key not in allowed:
                full = f"{prefix}{key}"
                raise self.error(
                    full,
                    f"unknown key{did_you_mean(str(key), allowed)}; valid keys: "
                    + ", ".join(sorted(allowed)),
                )

    def string(self, data: dict, key: str, full: str, default: Any = None, required=False) -> Any:
        if key not in data or data[key] is None:
            if required:
                raise self.error(full, "is required")
            return default
        value = data[key]
        if not isinstance(value, str) or not value.strip():
            raise self.error(full, f"must be a non-empty string, got {show(value)}")
        return value

    def integer(self, data: dict, key: str, full: str, default: int, lo: int, hi: int) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(full, f"must be an integer between {lo} and {hi}, got {show(value)}")
        if not lo <= value <= hi:
            raise self.error(full, f"must be between {lo} and {hi}, got {value}")
        return value

    def boolean(self, data: dict, key: str, full: str, default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            raise self.error(full, f"must be true or false, got {show(value)}")
        return value


def _where(r: "_Reader", key: str) -> str:
    """file:line of a key of the job file, for messages about what the key names."""
    line = r.lines.get(key)
    return f"{r.file}:{line}" if line else str(r.file)


def load_job(path: str | Path) -> Job:
    """Read and validate a job file. Raises UserError; starts nothing."""
    path = userfiles.resolve(path, "job file")
    text = userfiles.read_text(path, "job file")
    data = userfiles.load_yaml(text, path)
    if not isinstance(data, dict):
        raise UserError("a job file must be a YAML mapping (name:, train:, ...)", file=str(path))
    return parse_job(data, path, _line_map(text))


def parse_job(data: dict, path: Path, lines: dict[str, int] | None = None) -> Job:
    """Validate an already-parsed job mapping (``path`` anchors relative paths)."""
    r = _Reader(path, lines or {})
    r.check_keys(data, _TOP_KEYS, "")
    base = path.parent

    name = r.string(data, "name", "name", required=True)
    if not NAME_RE.match(name):
        raise r.error("name", "must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")

    inventory = r.string(data, "inventory", "inventory")
    hosts = r.string(data, "hosts", "hosts", default="all")

    nproc = data.get("nproc_per_node", 1)
    if nproc != "auto":
        nproc = r.integer(data, "nproc_per_node", "nproc_per_node", 1, 1, 1024)

    gpus = data.get("gpus_per_node", "auto")
    if gpus != "auto" and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= 1024):
        raise r.error("gpus_per_node", f"must be 'auto' or a whole number of GPUs from 0 to 1024, got {show(gpus)}")

    master_port = r.integer(data, "master_port", "master_port", 29500, 1, 65535)
    restarts = r.integer(data, "restarts", "restarts", 0, 0, 100)
    check = r.boolean(data, "check", "check", True)
    tokenize_once = r.boolean(data, "tokenize_once", "tokenize_once", True)
    notify = _notify(r, data.get("notify"))
    stage, stage_dir, stage_keep = _stage(r, data)
    stall_timeout = r.integer(data, "stall_timeout", "stall_timeout", 600, 0, 7 * 24 * 3600)
    if 0 < stall_timeout < MIN_STALL_TIMEOUT_S:
        raise r.error("stall_timeout", f"must be 0 (off) or at least {MIN_STALL_TIMEOUT_S} seconds, got {stall_timeout}")

    health = data.get("health", "refuse")
    health = "off" if health is False else health  # YAML 1.1 reads a bare `off` as false
    if health not in HEALTH_MODES:
        raise r.error("health", f"must be one of {', '.join(HEALTH_MODES)}"
                      f"{did_you_mean(str(health), HEALTH_MODES)}, got {show(health)}")

    divergence = data.get("divergence", "stop")
    if divergence not in DIVERGENCE_MODES:
        raise r.error("divergence", f"must be one of {', '.join(DIVERGENCE_MODES)} (a run whose loss went nan or "
                      "whose model collapsed is stopped, or named and let go on)"
                      f"{did_you_mean(str(divergence), DIVERGENCE_MODES)}, got {show(divergence)}")

    on_node_loss = data.get("on_node_loss", "stop")
    if on_node_loss not in NODE_LOSS_POLICIES:
        raise r.error("on_node_loss", f"must be one of {', '.join(NODE_LOSS_POLICIES)}"
                      f"{did_you_mean(str(on_node_loss), NODE_LOSS_POLICIES)}, got {show(on_node_loss)}")
    if on_node_loss != "stop" and restarts == 0:
        raise r.error("on_node_loss", f"{on_node_loss} acts when the run starts again after a host was lost: "
                      "set restarts: N (1 or more) beside it, or on_node_loss: stop")
    spares = r.string(data, "spares", "spares", default="spares")
    if "spares" in data and on_node_loss != "spare":
        raise r.error("spares", f"only applies to on_node_loss: spare (it is {on_node_loss})")
    min_nodes = r.integer(data, "min_nodes", "min_nodes", 1, 1, 100_000)
    keep_global_batch = r.boolean(data, "keep_global_batch", "keep_global_batch", True)
    for key in ("min_nodes", "keep_global_batch"):
        if key in data and on_node_loss == "stop":
            raise r.error(key, "only applies to on_node_loss: exclude or spare (with stop, a run never "
                          "goes on with fewer hosts)")

    straggler_factor = data.get("straggler_factor", 1.15)
    if (isinstance(straggler_factor, bool) or not isinstance(straggler_factor, (int, float))
            or not 1 < straggler_factor <= 100):
        raise r.error("straggler_factor", "must be a number above 1 (a node this many times slower than the "
                      f"fleet's median step time is named a straggler; 1.15 by default), got {show(straggler_factor)}")

    shared_dir = r.string(data, "shared_dir", "shared_dir")
    workdir = r.string(data, "workdir", "workdir")

    env_raw = data.get("env") or {}
    if not isinstance(env_raw, dict):
        raise r.error("env", "must be a mapping of NAME: value")
    env: dict[str, str] = {}
    for key, value in env_raw.items():
        if not isinstance(key, str) or not ENV_NAME_RE.match(key):
            raise r.error(f"env.{key}", "is not a valid environment variable name")
        if isinstance(value, (dict, list)) or value is None:
            raise r.error(f"env.{key}", f"must be a string, number or boolean, got {show(value)}")
        env[key] = str(value).lower() if isinstance(value, bool) else str(value)
        if "\0" in env[key]:
            raise r.error(f"env.{key}", "holds a NUL byte, which no environment variable can carry")
        size = len(key.encode()) + 1 + len(env[key].encode())
        if size >= ENV_ENTRY_MAX:
            raise r.error(f"env.{key}", f"is {size:,} bytes as {key}=value; the kernel passes at most "
                          f"{ENV_ENTRY_MAX - 1:,} in one (MAX_ARG_STRLEN): every node would fail with \"Argument list "
                          "too long\". Put the value in a file on shared storage and name the file here")
    if sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items()) > ENV_TOTAL_MAX:
        raise r.error("env", f"holds more than {ENV_TOTAL_MAX:,} bytes in all; with the host's own environment and "
                      "the command line it would pass the kernel's ARG_MAX (2 MiB on most hosts) and every node "
                      "would fail with \"Argument list too long\". Put large values in files on shared storage")
    if env.get("PATH", None) is not None and not any(d.startswith("/") for d in env["PATH"].split(":")):
        raise r.error("env.PATH", f"is {show(env['PATH'])}: no absolute directory, so no command (torchrun, python, "
                      "bash) would be found on any host (exit 127). Leave PATH out to keep each host's, or list "
                      "absolute directories")

    runtime = _parse_runtime(r, data.get("runtime"))
    train = _parse_train(r, data.get("train"), base)
    if "keep_global_batch" in data and train.mode != "llamafactory":
        raise r.error("keep_global_batch", f"only applies to a LlamaFactory job (ftbundle rescales its "
                      f"gradient_accumulation_steps); a {train.mode} job keeps its own batch: remove the key")
    if train.llamafactory is not None:
        _check_llamafactory(r, train, gpus)

    return Job(
        name=name,
        path=path,
        train=train,
        inventory=(base / inventory).resolve() if inventory else None,
        hosts=hosts,
        nproc_per_node=nproc,
        gpus_per_node=gpus,
        master_port=master_port,
        shared_dir=shared_dir,
        workdir=workdir,
        env=env,
        runtime=runtime,
        restarts=restarts,
        check=check,
        stall_timeout=stall_timeout,
        health=health,
        straggler_factor=float(straggler_factor),
        divergence=divergence,
        on_node_loss=on_node_loss,
        spares=spares,
        min_nodes=min_nodes,
        keep_global_batch=keep_global_batch,
        tokenize_once=tokenize_once,
        notify=notify,
        stage=stage,
        stage_dir=stage_dir,
        stage_keep=stage_keep,
    )


def _parse_runtime(r: _Reader, raw: Any) -> Runtime:
    if raw is None:
        return Runtime()
    if not isinstance(raw, dict):
        raise r.error("runtime", "must be a mapping with 'kind: host' or 'kind: docker'")
    r.check_keys(raw, _RUNTIME_KEYS, "runtime.")
    kind = r.string(raw, "kind", "runtime.kind", default="host")
    if kind not in ("host", "docker"):
        raise r.error("runtime.kind", f"must be 'host' or 'docker'{did_you_mean(kind, ['host', 'docker'])}, got {show(kind)}")
    python = r.string(raw, "python", "runtime.python", default="python3")
    image = r.string(raw, "image", "runtime.image")
    gpus = raw.get("gpus")
    if gpus is not None:
        gpus = str(gpus)
    if kind == "host" and (image or gpus):
        key = "runtime.image" if image else "runtime.gpus"
        raise r.error(key, "only applies to 'kind: docker'")
    if image is not None:
        check_pinned_image(image, lambda msg: r.error("runtime.image", msg))
    docker_args = raw.get("docker_args") or []
    if not isinstance(docker_args, list) or not all(isinstance(a, str) for a in docker_args):
        raise r.error("runtime.docker_args", "must be a list of strings")
    env_file = raw.get("env_file", DEFAULT_NCCL_ENV_FILE)
    if env_file is not None and (not isinstance(env_file, str) or not env_file.startswith("/")):
        raise r.error("runtime.env_file", "must be an absolute path on the hosts, or null")
    return Runtime(kind, python, image, gpus, tuple(docker_args), env_file)


def check_pinned_image(image: str, error) -> None:
    """A training image must be pinned by digest: a tag can resolve differently per node."""
    if not PINNED_IMAGE_RE.search(image):
        raise error(
            f"image {show(image)} is not pinned by digest; use repo@sha256:<64 hex>, or the image ID "
            "sha256:<64 hex> of an image loaded from a tarball (or leave runtime.image unset: ftbundle then "
            "runs the digest site.yml resolved and recorded on every host in /etc/ftbundle/image.ref)"
        )


def _parse_train(r: _Reader, raw: Any, base: Path) -> Train:
    if not isinstance(raw, dict):
        raise r.error("train", "is required: one of 'llamafactory', 'script' or 'command'")
    r.check_keys(raw, _TRAIN_KEYS, "train.")
    modes = [m for m in ("llamafactory", "script", "command") if raw.get(m) is not None]
    if len(modes) != 1:
        raise r.error("train", f"needs exactly one of llamafactory, script, command; got {modes or 'none'}")
    mode = modes[0]
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise r.error("train.args", "must be a list of strings")
    if args and mode != "script":
        raise r.error("train.args", "only applies to 'script'")
    deepspeed = r.string(raw, "deepspeed", "train.deepspeed")
    if deepspeed is not None and mode != "llamafactory":
        raise r.error("train.deepspeed", "only applies to 'llamafactory' (a script reads its own DeepSpeed config)")

    if mode == "llamafactory":
        value = raw["llamafactory"]
        if isinstance(value, dict):
            train = Train(mode, llamafactory=dict(value), llamafactory_source="train.llamafactory (inline)")
            return _with_deepspeed(r, train, deepspeed, base)
        if not isinstance(value, str):
            raise r.error("train.llamafactory", "must be a path to a LlamaFactory YAML config, or the config inline")
        cfg_path = userfiles.resolve(base / value, "LlamaFactory config", "train.llamafactory", _where(r, "train.llamafactory"))
        cfg = userfiles.load_yaml(
            userfiles.read_text(cfg_path, "LlamaFactory config", "train.llamafactory", _where(r, "train.llamafactory")),
            cfg_path)
        if not isinstance(cfg, dict):
            raise UserError("a LlamaFactory config must be a YAML mapping", file=str(cfg_path))
        train = Train(mode, llamafactory=cfg, llamafactory_source=str(cfg_path),
                      deepspeed_json=_deepspeed_beside(cfg, cfg_path))
        return _with_deepspeed(r, train, deepspeed, base)
    if mode == "script":
        return Train(mode, script=r.string(raw, "script", "train.script"), args=tuple(str(a) for a in args))
    return Train(mode, command=r.string(raw, "command", "train.command"))


def _check_llamafactory(r: _Reader, train: Train, gpus_per_node: int | str) -> None:
    """What LlamaFactory would refuse only after every host has started: no model, and a
    CPU job asking for half precision ("Your setup doesn't support bf16/gpu")."""
    cfg = train.llamafactory
    where = train.llamafactory_source or "train.llamafactory"
    file = where if not where.endswith("(inline)") else None

    def error(key: str, message: str) -> UserError:
        return UserError(message, file=file, key=key) if file else r.error(f"train.llamafactory.{key}", message)

    from .lfargs import judge

    findings = judge(cfg)
    if findings:
        first, rest = findings[0], findings[1:]
        more = f" (and {len(rest)} more: {', '.join(repr(f.key) for f in rest)})" if rest else ""
        if file:
            raise UserError(first.message + more, file=_line_of(file, first.key), key=first.key)
        raise r.error(f"train.llamafactory.{first.key}", first.message + more)
    model = cfg.get("model_name_or_path")
    if not isinstance(model, str) or not model.strip():
        raise error("model_name_or_path", "is required: the base model, a hub id (Qwen/Qwen2.5-7B-Instruct) or a "
                    f"path on the hosts; got {show(model)}")
    if gpus_per_node == 0:
        for key in ("bf16", "fp16", "pure_bf16"):
            if cfg.get(key) is True:
                raise error(key, f"{key}: true in a CPU job (the job's gpus_per_node: 0): half precision needs a GPU "
                            f"and LlamaFactory stops on every host with \"Your setup doesn't support bf16/gpu\". "
                            f"Remove it (or set {key}: false) and set use_cpu: true")


def _line_of(path: str, key: str) -> str:
    """``path:LINE`` of a top-level ``key:`` in a YAML file (``path`` when it is not found)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if re.match(rf"{re.escape(str(key))}\s*:", line):
                    return f"{path}:{n}"
    except OSError:
        pass
    return path


def _with_deepspeed(r: _Reader, train: Train, value: str | None, base: Path) -> Train:
    """The job's `train.deepspeed` (a preset name or a JSON file beside the job) wins over
    the LlamaFactory config's own `deepspeed:`; either way it is staged into the run dir."""
    if value is None:
        return train
    from . import deepspeed

    text = deepspeed.load(value, base, lambda msg: r.error("train.deepspeed", msg))
    return replace(train, llamafactory={**train.llamafactory, "deepspeed": value}, deepspeed_json=text)


def _deepspeed_beside(cfg: dict, cfg_path: Path) -> str | None:
    """The text of the config's DeepSpeed JSON when `deepspeed:` names a file that exists
    relative to the config (LlamaFactory's examples ship them side by side). A path that
    does not exist here is left alone: it may exist on the hosts (in the image, say)."""
    value = cfg.get("deepspeed")
    if not isinstance(value, str) or Path(value).is_absolute():
        return None
    path = cfg_path.parent / value
    if not path.is_file():
        return None
    text = userfiles.read_text(path, "DeepSpeed config", "deepspeed")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UserError(f"DeepSpeed config is not valid JSON: {exc}", file=str(path),
                        key="deepspeed") from None
    if not isinstance(data, dict):
        raise UserError(f"a DeepSpeed config must be a JSON object; this one is a {type(data).__name__}",
                        file=str(path), key="deepspeed")
    return text
