"""Plan -> Kubeflow manifests: a PyTorchJob (kubeflow.org/v1) or a TrainJob
(trainer.kubeflow.org/v1alpha1, runtime ``torch-distributed``). Pure: returns data, and
:func:`to_yaml` the multi-document text.

Each pod is one node: the operator sets the rendezvous (PET_NNODES, PET_NODE_RANK,
PET_MASTER_ADDR, ...), which torchrun reads by itself, so the command carries no ranks.
The run directory's files travel in a ConfigMap mounted at the run directory; the shared
directory is a PVC mounted at the same path as on the SSH hosts; secrets are
``secretKeyRef``s to a Secret that the cluster holds, never values.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ..errors import UserError
from . import ExportSpec

DNS_LABEL_RE = re.compile(r"[^a-z0-9-]+")
CONTAINER = {"k8s": "pytorch", "trainjob": "node"}  # the names each operator looks for


def dns_name(name: str) -> str:
    """A job name as a Kubernetes object name (lowercase letters, digits and '-')."""
    out = DNS_LABEL_RE.sub("-", name.lower()).strip("-")[:52]
    return out or "ftbundle-job"


def names(spec: ExportSpec, pvc: str | None, secret: str | None) -> dict[str, str]:
    base = dns_name(spec.name)
    return {"job": base, "files": f"{base}-files", "pvc": pvc or f"{base}-shared",
            "secret": secret or f"{base}-secrets"}


def _env(spec: ExportSpec, secret: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in spec.env.items()]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in spec.secret_names]
    env.append({"name": "FTB_WORKDIR", "value": spec.workdir})
    return env


def _command(spec: ExportSpec) -> list[str]:
    """torchrun without rendezvous flags (it reads the operator's PET_* variables); a
    per-node command gets the seeds' variables from them first."""
    if spec.train_mode == "command":
        return ["bash", "-c", ('export NODE_RANK="$PET_NODE_RANK" NNODES="$PET_NNODES" '
                               'NPROC_PER_NODE="$PET_NPROC_PER_NODE" MASTER_PORT="$PET_MASTER_PORT" '
                               'MASTER_ADDR="$PET_MASTER_ADDR"; exec "$@"'), "ftb-node", *spec.program]
    return [spec.python, "-m", "torch.distributed.run", *spec.program]


def _volumes(spec: ExportSpec, n: dict[str, str]) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "shared", "persistentVolumeClaim": {"claimName": n["pvc"]}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "shared", "mountPath": spec.shared_dir},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.files:
        volumes.append({"name": "run-files", "configMap": {"name": n["files"]}})
        mounts.append({"name": "run-files", "mountPath": spec.run_dir, "readOnly": True})
    return volumes, mounts


def _image(spec: ExportSpec, image: str | None) -> str:
    chosen = image or spec.image
    if not chosen:
        raise UserError("a Kubernetes pod needs an image: set runtime.kind: docker with runtime.image "
                        "(repo@sha256:...), or pass --image repo@sha256:...", file=spec.job_file, key="runtime.image")
    return chosen


def _gpu_resources(spec: ExportSpec) -> dict[str, Any]:
    return {"limits": {"nvidia.com/gpu": spec.nproc_per_node}} if spec.gpus else {}


def config_map(spec: ExportSpec, n: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": n["files"], "labels": {"app.kubernetes.io/managed-by": "ftbundle"}},
            "data": dict(sorted(spec.files.items()))}


def pytorchjob(spec: ExportSpec, *, image: str | None = None, pvc: str | None = None,
               secret: str | None = None) -> list[dict[str, Any]]:
    n = names(spec, pvc, secret)
    volumes, mounts = _volumes(spec, n)
    container = {"name": CONTAINER["k8s"], "image": _image(spec, image), "command": _command(spec),
                 "workingDir": spec.workdir, "env": _env(spec, n["secret"]), "volumeMounts": mounts,
                 "ports": [{"name": "pytorchjob-port", "containerPort": spec.master_port}]}
    if spec.gpus:
        container["resources"] = _gpu_resources(spec)
    policy = "OnFailure" if spec.restarts else "Never"

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": policy,
                "template": {"spec": {"containers": [container], "volumes": volumes}}}

    specs = {"Master": replicas(1)}
    if spec.nnodes > 1:
        specs["Worker"] = replicas(spec.nnodes - 1)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": n["job"], "labels": {"app.kubernetes.io/managed-by": "ftbundle"}},
           "spec": {"nprocPerNode": str(spec.nproc_per_node),
                    "runPolicy": {"backoffLimit": spec.restarts, "cleanPodPolicy": "Running"},
                    "pytorchReplicaSpecs": specs}}
    return ([config_map(spec, n)] if spec.files else []) + [job]


def trainjob(spec: ExportSpec, *, image: str | None = None, pvc: str | None = None,
             secret: str | None = None) -> list[dict[str, Any]]:
    n = names(spec, pvc, secret)
    volumes, mounts = _volumes(spec, n)
    trainer: dict[str, Any] = {"image": _image(spec, image), "command": _command(spec),
                               "env": _env(spec, n["secret"]), "numNodes": spec.nnodes,
                               "numProcPerNode": spec.nproc_per_node}
    if spec.gpus:
        trainer["resourcesPerNode"] = _gpu_resources(spec)
    pod = {"volumes": volumes, "containers": [{"name": CONTAINER["trainjob"], "volumeMounts": mounts}]}
    job = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
           "metadata": {"name": n["job"], "labels": {"app.kubernetes.io/managed-by": "ftbundle"},
                        # the TrainJob API has no restart policy of its own (the runtime's JobSet
                        # failure policy decides); the job's wish is recorded for the runtime's owner
                        "annotations": {"ftbundle.io/restarts": str(spec.restarts)}},
           "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": trainer,
                    "runtimePatches": [{"manager": "ftbundle", "trainingRuntimeSpec": {"template": {"spec": {
                        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}]}}
    return ([config_map(spec, n)] if spec.files else []) + [job]


class _Dumper(yaml.SafeDumper):
    """Plain YAML: the replicas share one container dict, but a reader wants no anchors."""

    def ignore_aliases(self, data):
        return True


def to_yaml(objects: list[dict[str, Any]], spec: ExportSpec, target: str, n: dict[str, str]) -> str:
    head = [f"# {spec.name}: written by `ftbundle export --to {target}` from {spec.job_file}",
            f"# {spec.nnodes} pod(s) x {spec.nproc_per_node} rank(s). Needs on the cluster:",
            "#   - the Kubeflow " + ("training operator (PyTorchJob)" if target == "k8s"
                                     else "Trainer with the torch-distributed ClusterTrainingRuntime"),
            f"#   - a ReadWriteMany PVC {n['pvc']} (mounted at {spec.shared_dir})"]
    if spec.secret_names:
        head.append(f"#   - a Secret {n['secret']} with keys {', '.join(spec.secret_names)}, e.g. "
                    f"kubectl create secret generic {n['secret']} "
                    + " ".join(f"--from-literal={k}=..." for k in spec.secret_names))
    head += [f"# warning: {w}" for w in spec.warnings]
    return "\n".join(head) + "\n" + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)
