"""Command lines for the two runtimes: the host's own interpreter, or a pinned image.

Pure functions from settings to argv lists; nothing here runs anything.
"""

from __future__ import annotations

import posixpath

from . import shipped
from .paths import is_under
from .rundir import LLAMAFACTORY_CONFIG, LLAMAFACTORY_ENTRY


def llamafactory_entry_source() -> str:
    """The entry script torchrun runs for LlamaFactory jobs (see shims/llamafactory_entry.py)."""
    return shipped.read_text("shims", "llamafactory_entry.py")

def steptimes_source() -> str:
    """Each rank's step-time callback (see shims/steptimes.py), staged for every trainer job."""
    return shipped.read_text("shims", "steptimes.py")


def steps_dir(run_id: str, rank: int) -> str:
    """Where a node's local ranks write their step times (shims/steptimes.py): /tmp of its host,
    one folder per run and node (each attempt's files in it), never shared storage (the node
    program reads them with every heartbeat, which must not hang). The docker runtime mounts it
    into the container at the same path."""
    return f"/tmp/ftb-steps-{run_id}-{rank}"


def host_steps_file(run_id: str, rank: int, attempt: int) -> str:
    """FTB_STEPS_FILE of a node's attempt: each local rank writes ``<it>.<LOCAL_RANK>``."""
    return f"{steps_dir(run_id, rank)}/a{attempt}.steps"


def torchrun_argv(python: str, *, nnodes: int, nproc_per_node: int, node_rank: int,
                  master_addr: str, master_port: int, log_dir: str | None = None) -> list[str]:
    """`python -m torch.distributed.run` (torchrun) with a static rendezvous on rank 0.

    The interpreter is named explicitly so the launch does not depend on which `torchrun`
    happens to be first on PATH on each host.

    With ``log_dir`` (the run directory's ``ranks/node-R``), torchrun gives every local rank
    a torch elastic error file there (``TORCHELASTIC_ERROR_FILE``: the failing rank's own
    traceback, written by ``@record``), and local ranks other than 0 write their output to
    files of their own there instead of the node's log: the log, and the terminal, carry
    local rank 0 alone, and nothing any rank says is lost.
    """
    extra: list[str] = []
    if log_dir:
        extra += ["--log-dir", log_dir]
        if nproc_per_node > 1:
            extra += ["--redirects", ",".join(f"{r}:3" for r in range(1, nproc_per_node))]
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--nproc_per_node", str(nproc_per_node),
        "--node_rank", str(node_rank),
        "--master_addr", master_addr,
        "--master_port", str(master_port),
        *extra,
    ]


def program_argv(mode: str, *, run_dir: str, script: str | None = None, args: tuple[str, ...] = (),
                 command: str | None = None) -> list[str]:
    """What each node runs for the job's train mode: under torchrun (LlamaFactory, a script),
    or once per node on its own (a `command:`)."""
    if mode == "llamafactory":
        return [posixpath.join(run_dir, LLAMAFACTORY_ENTRY), posixpath.join(run_dir, LLAMAFACTORY_CONFIG)]
    if mode == "script":
        return [script, *args]
    if mode == "command":
        # Run once per node, like the seeds' per-node scripts; they read NNODES,
        # NODE_RANK, MASTER_ADDR, MASTER_PORT and NPROC_PER_NODE themselves.
        return ["bash", "-c", command]
    raise ValueError(f"unknown train mode {mode!r}")


def container_name(run_id: str, rank: int) -> str:
    return f"ftb-{run_id}-{rank}"


def docker_prefix(*, image: str, name: str, shared_dir: str, workdir: str, env_names: list[str],
                  env_file: str | None, gpus: str | None, infiniband: bool = False,
                  extra: tuple[str, ...] = (), steps: str | None = None, stage_dir: str | None = None) -> list[str]:
    """`docker run ... IMAGE` for one node (the command follows): host network and IPC (NCCL
    needs both), the shared directory at the same path, the image by digest, the GPUs, the
    InfiniBand devices with the locked memory RDMA needs, and the environment passed by name
    so values (secrets included) never appear on a command line. ``steps``: the ranks' step-time
    folder (:func:`steps_dir`), mounted at its own path, FTB_STEPS_FILE passed in. ``stage_dir``:
    the hosts' staged copies of the model and dataset, mounted read-only at their own path."""
    argv = [
        "docker", "run", "--rm", "--init", "--name", name,
        "--network", "host", "--ipc", "host",
        "-v", f"{shared_dir}:{shared_dir}",
    ]
    if not is_under(workdir, shared_dir):
        argv += ["-v", f"{workdir}:{workdir}"]
    if steps:
        argv += ["-v", f"{steps}:{steps}", "-e", "FTB_STEPS_FILE"]
    argv += ["-e", "FTB_DIVERGED_FILE"]  # (the ranks' verdict on a nan or collapsed run: shims/steptimes.py)
    if stage_dir:  # the staged copies (ftbundle/stage.py), read-only
        argv += ["-v", f"{stage_dir}:{stage_dir}:ro"]
    argv += ["-w", workdir]
    if gpus:
        argv += ["--gpus", gpus, "--ulimit", "stack=67108864"]
    if gpus or infiniband:
        argv += ["--ulimit", "memlock=-1"]
    if infiniband:
        argv += ["--device", "/dev/infiniband", "--cap-add", "IPC_LOCK"]
    if env_file:
        argv += ["--env-file", env_file]
    for env_name in env_names:
        if gpus and gpus != "all" and env_name == "CUDA_VISIBLE_DEVICES":
            continue  # the chosen devices are renumbered 0..n-1 inside the container
        argv += ["-e", env_name]
    argv += list(extra)
    argv.append(image)
    return argv


def docker_stop_argv(name: str) -> list[str]:
    """Removing the container is what actually stops it: killing `docker run` does not."""
    return ["docker", "rm", "-f", name]
