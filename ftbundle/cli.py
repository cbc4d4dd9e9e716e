"""The `ftbundle` command line: parse flags, then hand over to the command's module.

Each command's logic lives in ftbundle/commands/<name>.py. User mistakes
(:class:`UserError`) become one clear message and exit code 2, before anything is started
anywhere; Ctrl-C, SIGTERM and SIGHUP become exit 130 after the command's own teardown.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

from . import __version__
from .errors import EXIT_USAGE, UserError

# Each subcommand's module is imported when it runs, not all of them at every start: `run`
# does not pay for the exporters (~5 ms of a start that sends its first SSH byte ~0.15 s in).
cmd_check = "check:cmd_check"
cmd_export = "export:cmd_export"
cmd_init = "init:cmd_init"
cmd_plot = "plot:cmd_plot"
cmd_run = "run:cmd_run"
cmd_runs = "runs:cmd_runs"
cmd_stage = "stage:cmd_stage"
cmd_status, cmd_logs = "status:cmd_status", "status:cmd_logs"
cmd_stacks, cmd_stop = "status:cmd_stacks", "status:cmd_stop"


def _command(func):
    """A subcommand's function: ``"module:name"`` in ftbundle.commands, imported now."""
    if not isinstance(func, str):
        return func
    import importlib

    module, _, name = func.partition(":")
    return getattr(importlib.import_module(f"{__package__}.commands.{module}"), name)


def _lines(text: str) -> int:
    """-n: a count of lines, 0 or more (argparse exits 2 naming -n and this message)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of lines, 0 or more; got {text!r}")
    return value


def _runs(text: str) -> int:
    """runs --last: a count of runs, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a number of runs, 1 or more; got {text!r}")
    return value


def _seconds(text: str) -> float:
    """--burn-in SECONDS: 1 to 3600 (the job file goes first: `check JOB --burn-in 5`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (the job file goes first: "
                                         "ftbundle check JOB --burn-in [SECONDS])") from None
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 1 to 3600 seconds; got {text!r}")
    return value


def _fraction(text: str) -> float:
    """--slow-below: a fraction of the fleet's median, above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction of the fleet's median above 0 and at most 1 "
                                         f"(0.9: more than 10% slower than the median); got {text!r}")
    return value


def cmd_completion(args: argparse.Namespace) -> int:
    from .completion import script

    print(script(args.shell, _PARSER))
    return 0


def _on_sigterm(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # once is enough: the teardown must not be cut short
    raise KeyboardInterrupt


EXAMPLES = """\
examples:
  ftbundle init                              write job.yaml, train.yaml, inventory.yml (asks on a terminal)
  ftbundle run job.yaml                      check the hosts, launch, show progress, summarize
  ftbundle run job.yaml --dry-run            print every host's command and environment
  ftbundle run job.yaml -v                   rank 0's raw output instead of the progress display
  ftbundle logs job.yaml -f                  follow the latest run's rank 0 log
  ftbundle logs job.yaml --all -f            every rank's output, merged, prefixed host:rank
  ftbundle runs job.yaml                     past runs: state, duration, final loss
  ftbundle plot job.yaml -o loss.png         loss and learning rate of the latest run
  ftbundle stage job.yaml                    copy the job's model and dataset to every host now
  source <(ftbundle completion bash)         shell completion (bash; zsh via bashcompinit)
"""

_PARSER: argparse.ArgumentParser | None = None


def main(argv: list[str] | None = None) -> int:
    global _PARSER
    parser = argparse.ArgumentParser(
        prog="ftbundle", description="Launch multi-node fine-tuning on an Ansible inventory.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _PARSER = parser
    parser.add_argument("--version", action="version", version=f"ftbundle {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    hosts = argparse.ArgumentParser(add_help=False)  # how every subcommand reaches the hosts
    hosts.add_argument("-i", "--inventory", help="Ansible inventory (overrides the job's 'inventory')")
    hosts.add_argument("--vault-password-file", metavar="FILE",
                       help="for vault-encrypted inventory vars (default: $ANSIBLE_VAULT_PASSWORD_FILE)")
    hosts.add_argument("--accept-new-host-keys", action="store_true",
                       help="trust hosts whose SSH key is not in known_hosts yet, and record it there "
                            "(default: refused, as OpenSSH does)")

    run = sub.add_parser("run", help="launch a job on every host of the inventory", parents=[hosts])
    run.add_argument("job", help="the job file (job.yaml)")
    run.add_argument("--dry-run", action="store_true", help="print each host's command and environment; start nothing")
    run.add_argument("--detach", action="store_true",
                     help="start the job and return; follow it later with status/logs/stop")
    run.add_argument("--no-check", action="store_true",
                     help="skip the pre-launch check of the hosts (as 'check: false' in the job)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="show rank 0's raw output instead of the progress display")
    run.set_defaults(func=cmd_run)

    chk = sub.add_parser("check", help="check the hosts of a job are alike and ready; launch nothing",
                         parents=[hosts])
    chk.add_argument("job", help="the job file (job.yaml)")
    chk.add_argument("--net", action="store_true",
                     help="also measure the network: iperf3 to rank 0 from every host, and an all-reduce")
    chk.add_argument("--min-gbps", type=float, default=None,
                     help="warn about links slower than this, in Gbit/s (default 10)")
    chk.add_argument("--burn-in", type=_seconds, nargs="?", const=10.0, default=None, metavar="SECONDS",
                     help="also load every host at once for SECONDS (default 10): per GPU a bf16 GEMM and an "
                          "HBM copy, on a CPU host a CPU GEMM; hosts slower than the fleet's median are named")
    chk.add_argument("--slow-below", type=_fraction, default=None, metavar="FRACTION",
                     help="with --burn-in: name a host slow below this fraction of the fleet's median (default 0.9)")
    chk.set_defaults(func=cmd_check)

    stg = sub.add_parser("stage", help="copy the job's stage: (model, dataset, paths) to every host's stage_dir now",
                         parents=[hosts])
    stg.add_argument("job", help="the job file (job.yaml)")
    stg.set_defaults(func=cmd_stage)

    for name, func, text in (("status", cmd_status, "state of every node of a run"),
                             ("logs", cmd_logs, "a rank's output (rank 0's by default), or --all ranks'"),
                             ("stop", cmd_stop, "stop every node of a run"),
                             ("stacks", cmd_stacks, "every rank's state and Python stack, grouped; the run goes on")):
        p = sub.add_parser(name, help=text, parents=[hosts])
        p.add_argument("job", help="the job file the run was started from")
        p.add_argument("--run", help="run id (default: the job's latest run)")
        if name == "logs":
            p.add_argument("--rank", help="a global rank (5) or NODE:LOCAL (2:1); default: node 0's log")
            p.add_argument("--all", action="store_true",
                           help="every node's and local rank's output, merged in time order, prefixed host:rank")
            p.add_argument("-f", "--follow", action="store_true", help="follow until the job ends (every node's)")
            p.add_argument("-n", "--lines", type=_lines, default=50, help="lines to show first (default 50)")
        p.set_defaults(func=func)

    exp = sub.add_parser("export", help="write the job as a Slurm, Kubeflow (PyTorchJob, TrainJob) or PBS job")
    exp.add_argument("job", help="the job file (job.yaml)")
    exp.add_argument("--to", required=True, help="slurm | k8s (PyTorchJob) | trainjob (Kubeflow Trainer) | pbs")
    exp.add_argument("-i", "--inventory", help="Ansible inventory (overrides the job's 'inventory')")
    exp.add_argument("--nodes", help="number of nodes (default: the inventory's host count)")
    exp.add_argument("--partition", help="Slurm partition / PBS queue")
    exp.add_argument("--time", help="time limit (Slurm --time, PBS walltime)")
    exp.add_argument("--container", default="pyxis", help="slurm, docker runtime: pyxis (--container-image, "
                     "default) or docker (docker run on each node)")
    exp.add_argument("--image", help="k8s/trainjob: the image (repo@sha256:...) when the job's runtime is not docker")
    exp.add_argument("--pvc", help="k8s/trainjob: the shared volume's claim (default: <job name>-shared)")
    exp.add_argument("--secret", help="k8s/trainjob: the Secret holding the job's secrets (default: <job name>-secrets)")
    exp.add_argument("--gres", action="store_true", help="slurm: ask for GPUs as --gres=gpu:N "
                     "(default: --gpus-per-node=N)")
    exp.add_argument("--cpus-per-node", help="cores per node; default: the whole node (slurm --exclusive, "
                     "pbs place=excl; k8s: 4 per rank)")
    exp.add_argument("--mem", help="memory per node, e.g. 64G (default: slurm all of the node's, k8s 16Gi per rank)")
    exp.add_argument("--node-gpus", help="GPUs each of the cluster's nodes has: warn when the job asks for more")
    exp.add_argument("--torque", action="store_true", help="pbs: Torque's nodes=N:ppn=C:gpus=G (default: PBS Pro select=)")
    exp.add_argument("--launcher", default="pbsdsh", help="pbs: how each node is started: pbsdsh (default) or ssh")
    exp.add_argument("--dry-run", action="store_true", help="print what each node will request and write nothing")
    exp.add_argument("-o", "--output", help="write here instead of stdout")
    exp.set_defaults(func=cmd_export)

    runs = sub.add_parser("runs", help="past runs of a job: state, duration, final loss", parents=[hosts],
                          epilog="example: ftbundle runs job.yaml --json | jq '.[-1].final_loss'")
    runs.add_argument("job", nargs="?", help="the job file (default: ./job.yaml)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    runs.add_argument("--all", action="store_true", help="every job's runs in the shared directory")
    runs.add_argument("--last", type=_runs, default=None, metavar="N",
                      help="only the newest N runs (a week of restarts lists hundreds)")
    runs.set_defaults(func=cmd_runs)

    plot = sub.add_parser("plot", help="plot loss and learning rate of runs", parents=[hosts],
                          epilog="example: ftbundle plot job.yaml --run RUN_A --run RUN_B -o compare.png")
    plot.add_argument("job", help="the job file the runs were started from")
    plot.add_argument("--run", action="append", help="run id; repeat to overlay runs (default: the latest)")
    plot.add_argument("-o", "--output", help="write a PNG here (default on a terminal: a plot in the "
                                             "terminal; otherwise loss.png)")
    plot.set_defaults(func=cmd_plot)

    init = sub.add_parser("init", help="write a job, a LlamaFactory config and an inventory stub",
                          epilog="example: ftbundle init --hosts gpu1,gpu2 --gpus 8 --model Qwen/Qwen2.5-7B "
                                 "--mode lora")
    init.add_argument("--dir", default=".", help="where to write the files (default: here)")
    init.add_argument("--name", help="job name (default: the directory's name)")
    init.add_argument("--hosts", help="comma-separated host names or addresses (default: localhost)")
    init.add_argument("--gpus", type=int, help="GPUs per host (default 8; 2 CPU ranks on localhost)")
    init.add_argument("--model", help="model path or hub id")
    init.add_argument("--mode", choices=["lora", "qlora", "full"], help="fine-tuning method (default lora)")
    init.add_argument("--shared-dir", help="shared storage path on every host (default /shared/ftbundle)")
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    init.add_argument("--yes", "-y", action="store_true", help="take flags and defaults; ask nothing")
    init.set_defaults(func=cmd_init)

    comp = sub.add_parser("completion", help="print a shell completion script",
                          epilog="example: ftbundle completion bash > /etc/bash_completion.d/ftbundle")
    comp.add_argument("shell", choices=["bash", "zsh"])
    comp.set_defaults(func=cmd_completion)

    args = parser.parse_args(argv)
    if getattr(args, "vault_password_file", None):
        os.environ["ANSIBLE_VAULT_PASSWORD_FILE"] = os.path.abspath(args.vault_password_file)
    # a closed terminal (SIGHUP) or a kill (SIGTERM) stops the run as Ctrl-C does
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, _on_sigterm)
    # `kill -USR1 <pid>`: every thread's stack on stderr, for a launcher that seems stuck
    # (not where stderr has no file descriptor: main() called in-process, its stderr captured)
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both OSError and ValueError
        pass
    try:
        return _command(args.func)(args)
    except UserError as exc:
        print(f"ftbundle: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("ftbundle: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
