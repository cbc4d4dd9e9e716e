"""`ftbundle export`: the job as an sbatch script, Kubeflow manifests or a qsub script.

The plan is built here for N placeholder hosts (the scheduler's nodes are not known when
the file is written); the text comes from the pure renderers in ftbundle/export/.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ..errors import UserError, did_you_mean
from ..export import (TARGETS, Resources, check_image, parse_count, parse_mem, resource_warnings,
                      spec_from)
from ..inventory import resolve_hosts
from ..job import Job, load_job
from ..layout import make_layout, new_run_id
from ..plan import Plan, make_plan
from .common import say


def export_plan(job_path: str, inventory: str | None, nodes: int | None) -> tuple[Job, Plan]:
    """The job and its plan for ``nodes`` scheduler nodes: placeholder hosts that keep the
    inventory's variables (ftb_shared_dir, ftb_image)."""
    job = load_job(job_path)
    if job.nproc_per_node == "auto":
        raise UserError("export needs a number of ranks per node: the scheduler's nodes are not known "
                        "when the file is written; set nproc_per_node to the GPUs per node",
                        file=str(job.path), key="nproc_per_node")
    hosts = resolve_hosts(job, inventory)
    count = nodes if nodes is not None else len(hosts)
    placeholders = [replace(hosts[i % len(hosts)], name=f"node{i}", address=f"ftb-export-node{i}",
                            local=False, port=22) for i in range(count)]
    return job, make_plan(make_layout(job, placeholders, new_run_id(job.name)))


def check_target(to: str) -> str:
    if to not in TARGETS:
        raise UserError(f"unknown export target {to!r}{did_you_mean(to, TARGETS)}; valid: {', '.join(TARGETS)}",
                        key="--to")
    return to


def parse_nodes(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        nodes = int(value)
    except ValueError:
        nodes = 0
    if not 1 <= nodes <= 100000:
        raise UserError(f"must be a whole number of nodes (1 or more), got {value!r}", key="--nodes")
    return nodes


def export(job_path: str, *, to: str, inventory: str | None = None, nodes: str | None = None,
           partition: str | None = None, time: str | None = None, container: str = "pyxis",
           image: str | None = None, pvc: str | None = None, secret: str | None = None,
           gres: bool = False, cpus_per_node: str | None = None, mem: str | None = None,
           node_gpus: str | None = None, torque: bool = False, launcher: str = "pbsdsh",
           ) -> tuple[str, tuple[str, ...], str]:
    """The scheduler's text for a job, its warnings, and one line saying what each node
    requests. Raises UserError before anything is written."""
    check_target(to)
    for flag, given, target in (("--gres", gres, "slurm"), ("--torque", torque, "pbs"),
                                ("--launcher", launcher != "pbsdsh", "pbs")):
        if given and to != target:  # a request this target cannot express: say so, not ignore it
            raise UserError(f"only applies to --to {target}", key=flag)
    count = parse_nodes(nodes)
    cpus = parse_count(cpus_per_node, "--cpus-per-node")
    have = parse_count(node_gpus, "--node-gpus", lo=0)
    mem = parse_mem(mem)
    if image is not None:
        check_image(image, "--image")
    job, plan = export_plan(job_path, inventory, count)
    spec = spec_from(job, plan)
    spec = replace(spec, warnings=(*spec.warnings, *resource_warnings(spec, have)))
    if job.stage:  # (ftbundle's own copy to each host: a scheduler's job reads the paths as written)
        spec = replace(spec, warnings=(*spec.warnings, (
            f"stage: ({', '.join(job.stage)}) is not exported: the {to} job reads the model and dataset where the "
            "job names them (on shared storage, every node reads them there); run `ftbundle stage` on the nodes, "
            "or point the config at a copy each node holds")))
    res = Resources(gpus_per_node=spec.gpus_per_node, cpus_per_node=cpus, mem=mem)
    summary = f"requests {spec.nnodes} node(s) x {res.describe()}"
    if to == "slurm":
        from ..export.slurm import render

        text = render(spec, res, partition=partition, time=time, container=container, gres=gres)
        return text, spec.warnings, summary
    if to == "pbs":
        from ..export.pbs import render as render_pbs

        return render_pbs(spec, res, queue=partition, time=time, torque=torque, launcher=launcher), \
            spec.warnings, summary
    from ..export import k8s

    model = str((job.train.llamafactory or {}).get("model_name_or_path") or "") if job.train.mode == "llamafactory" \
        else ""
    hub_model = model if model and not model.startswith(("/", ".", "~")) else None
    spec = replace(spec, warnings=(*spec.warnings, *k8s.cache_warnings(spec, hub_model)))
    make = k8s.pytorchjob if to == "k8s" else k8s.trainjob
    n = k8s.names(spec, pvc, secret)
    objects = make(spec, res, image=image, n=n)
    summary = f"requests {spec.nnodes} pod(s) x {k8s.describe(spec, res)}"
    return k8s.to_yaml(objects, spec, to, n, res), spec.warnings, summary


def cmd_export(args: argparse.Namespace) -> int:
    """The job as an sbatch script, Kubeflow manifests or a qsub script: to -o or stdout."""
    text, warnings, summary = export(
        args.job, to=args.to, inventory=args.inventory, nodes=args.nodes, partition=args.partition,
        time=args.time, container=args.container, image=args.image, pvc=args.pvc, secret=args.secret,
        gres=args.gres, cpus_per_node=args.cpus_per_node, mem=args.mem, node_gpus=args.node_gpus,
        torque=args.torque, launcher=args.launcher)
    for warning in warnings:
        say(f"warning: {warning}")
    say(summary)
    if args.dry_run:
        return 0
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        try:
            with open(args.output, "w") as out:
                out.write(text)
        except OSError as exc:
            raise UserError(f"cannot write: {exc.strerror}", file=args.output, key="-o") from None
        say(f"wrote {args.output}")
    return 0
