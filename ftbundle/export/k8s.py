"""Plan -> Kubeflow manifests: a PyTorchJob (kubeflow.org/v1) or a TrainJob
(trainer.kubeflow.org/v1alpha1, runtime ``torch-distributed``). Pure: returns data, and
:func:`to_yaml` the multi-document text.

Each pod is one node: the operator sets the rendezvous (PET_NNODES, PET_NODE_RANK,
PET_MASTER_ADDR, ...), which torchrun reads by itself, so the command carries no ranks.
The run directory's files travel in a ConfigMap mounted at the run directory; the shared
directory is a PVC mounted at the same path as on the SSH hosts; secrets are
``secretKeyRef``s to a Secret that the cluster holds, never values.

Names: every object name is a DNS-1035 label (what the TrainJob CRD's CEL rule and the
Services the operators create need), derived from the job name; a name that had to be
changed gets a hash of the original, so two jobs never share one. The job name is kept
to 40 characters, leaving room for what the operators append (``-worker-12``, JobSet's
``-node-0-0``) within a label's 63.

Minimum controller versions (the CRDs these manifests were validated against, offline):
PyTorchJob's ``nprocPerNode`` needs the Kubeflow training-operator v1.7 or later
(validated against its CRD at commit 374e88a, Dec 2024); the TrainJob's
``runtimePatches`` need a Kubeflow Trainer whose CRD has them (validated against commit
8c0f505, Aug 2026). No API server ran them here.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import yaml

from ..errors import UserError
from ..paths import is_under
from . import ExportSpec, Resources, refuse_uneven

NOT_LABEL_RE = re.compile(r"[^a-z0-9-]+")
DNS_1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
JOB_NAME_MAX = 40
CONTAINER = {"k8s": "pytorch", "trainjob": "node"}  # the names each operator looks for
VERSIONS = {"k8s": "Kubeflow training-operator v1.7 or later (nprocPerNode)",
            "trainjob": "Kubeflow Trainer with TrainJob runtimePatches (CRD of Aug 2026, commit 8c0f505) "
                        "and the torch-distributed ClusterTrainingRuntime"}
# requests per rank when --cpus-per-node / --mem are not given
CPU_PER_RANK, MEM_PER_RANK_GI = 4, 16


def dns_label(name: str, limit: int = 63) -> str:
    """Any name as a DNS-1035 label of at most ``limit`` characters: stable (the same name
    gives the same label) and collision-safe (a changed name ends in a hash of the original)."""
    if DNS_1035_RE.match(name) and len(name) <= limit:
        return name
    base = re.sub("-+", "-", NOT_LABEL_RE.sub("-", name.lower())).strip("-")
    if not base[:1].isalpha():
        base = "ftb-" + base
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{base[:limit - len(digest) - 1].rstrip('-')}-{digest}"


def check_name(value: str, flag: str) -> str:
    if not (DNS_1123_SUBDOMAIN_RE.match(value) and len(value) <= 253):
        raise UserError(f"{value!r} is not a Kubernetes object name: lowercase letters, digits, '-' and '.', "
                        "starting and ending with a letter or digit", key=flag)
    return value


def names(spec: ExportSpec, pvc: str | None, secret: str | None) -> dict[str, str]:
    base = dns_label(spec.name, JOB_NAME_MAX)
    return {"job": base, "files": f"{base}-files",
            "pvc": check_name(pvc, "--pvc") if pvc else f"{base}-shared",
            "secret": check_name(secret, "--secret") if secret else f"{base}-secrets"}


def _env(spec: ExportSpec, secret: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in spec.env.items()]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in spec.secret_names]
    env.append({"name": "FTB_WORKDIR", "value": spec.workdir})
    return env


def _command(spec: ExportSpec, cd: bool = False) -> list[str]:
    """torchrun without rendezvous flags (it reads the operator's PET_* variables); a
    per-node command gets the seeds' variables from them first. ``cd``: the work directory
    (a TrainJob's trainer has no workingDir), so that relative paths mean what they do on SSH."""
    go = 'cd -- "$FTB_WORKDIR" && ' if cd else ""
    if spec.restarts and spec.checkpoint_dir:
        # a pod restarted after dying while saving: the half-written checkpoint goes first,
        # as on SSH and Slurm (the first node prunes; the trainer then resumes from the last)
        from .shell import RESUME_POINT, q

        go = (RESUME_POINT + '\nif [ "${PET_NODE_RANK:-0}" = 0 ]; then ftb_resume_point '
              + q(spec.checkpoint_dir) + " >/dev/null; fi\n" + go)
        cd = True
    if spec.train_mode == "command":
        return ["bash", "-c", (go + 'export NODE_RANK="$PET_NODE_RANK" NNODES="$PET_NNODES" '
                               'NPROC_PER_NODE="$PET_NPROC_PER_NODE" MASTER_PORT="$PET_MASTER_PORT" '
                               'MASTER_ADDR="$PET_MASTER_ADDR"; exec "$@"'), "ftb-node", *spec.program]
    if cd:
        return ["bash", "-c", go + 'exec "$@"', "ftb-node", spec.python, "-m", "torch.distributed.run", *spec.program]
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


HF_CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE")


def cache_warnings(spec: ExportSpec, hub_model: str | None) -> list[str]:
    """A pod's own disk is lost with the pod: a Hugging Face cache there is downloaded again by
    every pod, on every restart. Said for each cache variable pointing outside shared_dir (the
    one volume every pod shares), and for a job that downloads a hub model with none set."""
    def under_shared(path: str) -> bool:
        return is_under(path, spec.shared_dir)

    out = [f"{name}={spec.env[name]} is outside shared_dir ({spec.shared_dir}): in a pod that is the "
           "container's own disk, lost with the pod, and every pod downloads the model again; set it under "
           "shared_dir" for name in HF_CACHE_VARS if spec.env.get(name) and not under_shared(spec.env[name])]
    if hub_model and not any(spec.env.get(name) for name in HF_CACHE_VARS):
        out.append(f"the model {hub_model} comes from the Hugging Face hub and no HF_HOME is set: every pod "
                   "downloads it into its own container's ~/.cache (again on each restart); set HF_HOME "
                   f"under shared_dir in the job's env, e.g. {spec.shared_dir.rstrip('/')}/hf")
    return out


def _image(spec: ExportSpec, image: str | None) -> str:
    chosen = image or spec.image
    if not chosen:
        raise UserError("a Kubernetes pod needs an image: set runtime.kind: docker with runtime.image "
                        "(repo@sha256:...), or pass --image repo@sha256:...", file=spec.job_file, key="runtime.image")
    return chosen


def resources(spec: ExportSpec, res: Resources) -> dict[str, Any]:
    """One node's pod: its GPUs as a limit (extended resources are limits), CPU and memory
    as requests (the scheduler places by them; no limit, so a rank is not OOM-killed at it)."""
    cpu = res.cpus_per_node or CPU_PER_RANK * spec.nproc_per_node
    mem = f"{res.mem}i" if res.mem and not res.mem[-1].isdigit() else f"{res.mem}Mi" if res.mem \
        else f"{MEM_PER_RANK_GI * spec.nproc_per_node}Gi"
    out: dict[str, Any] = {"requests": {"cpu": str(cpu), "memory": mem}}
    if spec.gpus_per_node:
        out["limits"] = {"nvidia.com/gpu": spec.gpus_per_node}
    return out


def describe(spec: ExportSpec, res: Resources) -> str:
    r = resources(spec, res)
    gpus = r.get("limits", {}).get("nvidia.com/gpu", "0")
    return f"{gpus} nvidia.com/gpu (limit), {r['requests']['cpu']} CPU, {r['requests']['memory']} memory (requests)"


def config_map(spec: ExportSpec, n: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": n["files"], "labels": {"app.kubernetes.io/managed-by": "ftbundle"}},
            "data": dict(sorted(spec.files.items()))}


def pytorchjob(spec: ExportSpec, res: Resources, *, image: str | None = None,
               n: dict[str, str]) -> list[dict[str, Any]]:
    refuse_uneven(spec, "k8s", "a PyTorchJob has one nprocPerNode for every pod (and one resources block "
                  "per replica type)")
    volumes, mounts = _volumes(spec, n)
    container = {"name": CONTAINER["k8s"], "image": _image(spec, image), "command": _command(spec),
                 "workingDir": spec.workdir, "env": _env(spec, n["secret"]), "volumeMounts": mounts,
                 "ports": [{"name": "pytorchjob-port", "containerPort": spec.master_port}],
                 "resources": resources(spec, res)}
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
                    # the operator counts every pod's restarts; one restart of the job (static
                    # rendezvous: every node's torchrun ends) restarts each of its pods once
                    "runPolicy": {"backoffLimit": spec.restarts * spec.nnodes, "cleanPodPolicy": "Running"},
                    "pytorchReplicaSpecs": specs}}
    return ([config_map(spec, n)] if spec.files else []) + [job]


def trainjob(spec: ExportSpec, res: Resources, *, image: str | None = None,
             n: dict[str, str]) -> list[dict[str, Any]]:
    refuse_uneven(spec, "trainjob", "a TrainJob has one numProcPerNode and one resourcesPerNode for every node")
    volumes, mounts = _volumes(spec, n)
    trainer: dict[str, Any] = {"image": _image(spec, image), "command": _command(spec, cd=True),
                               "env": _env(spec, n["secret"]), "numNodes": spec.nnodes,
                               "numProcPerNode": spec.nproc_per_node, "resourcesPerNode": resources(spec, res)}
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


def to_yaml(objects: list[dict[str, Any]], spec: ExportSpec, target: str, n: dict[str, str],
            res: Resources) -> str:
    from .shell import comment

    head = [f"# {spec.name}: written by `ftbundle export --to {target}` from {spec.job_file}",
            f"# {spec.nnodes} pod(s) x {spec.nproc_per_node} rank(s), each pod: {describe(spec, res)}",
            "# Needs on the cluster:",
            f"#   - the {VERSIONS[target]}",
            f"#   - a ReadWriteMany PVC {n['pvc']} (mounted at {spec.shared_dir})"]
    if spec.secret_names:
        head.append(f"#   - a Secret {n['secret']} with keys {', '.join(spec.secret_names)}, e.g. "
                    f"kubectl create secret generic {n['secret']} "
                    + " ".join(f"--from-literal={k}=..." for k in spec.secret_names))
    head += [f"# warning: {w}" for w in spec.warnings]
    return "\n".join(comment(h) for h in head) + "\n" + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)
