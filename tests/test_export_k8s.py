"""`ftbundle export --to k8s / trainjob`: manifests that the Kubeflow CRDs' own
openAPIV3Schema accepts (jsonschema, CRDs vendored under tests/data/k8s-crds), and the
ConfigMap that Kubernetes' own schema accepts (kubernetes-validate)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from ftbundle.cli import main

CRDS = Path(__file__).parent / "data" / "k8s-crds"
DIGEST = "registry.example.com/train/llamafactory@sha256:" + "ab" * 32
SECRET_VALUE = "hf_verysecretvalue123"


def crd_validator(file: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((CRDS / file).read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


PYTORCHJOB = crd_validator("kubeflow.org_pytorchjobs.yaml")
TRAINJOB = crd_validator("trainer.kubeflow.org_trainjobs.yaml")


def write_job(tmp_path: Path, *, restarts=2, use_cpu=False, runtime=None, extra="") -> Path:
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "stage": "sft", "do_train": True, "finetuning_type": "lora", "dataset": "support",
        "output_dir": "output/lora", "save_total_limit": 2, "use_cpu": use_cpu}))
    runtime = runtime or {"kind": "docker", "image": DIGEST, "gpus": "all"}
    job = {"name": "Support_LoRA", "nproc_per_node": 4, "shared_dir": "/shared/ftb", "restarts": restarts,
           "env": {"HF_TOKEN": SECRET_VALUE, "NCCL_DEBUG": "WARN"}, "runtime": runtime,
           "train": {"llamafactory": "train.yaml"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job) + extra)
    return tmp_path / "job.yaml"


def export(tmp_path, job: Path, to: str, *args: str) -> list[dict]:
    out = tmp_path / f"out-{to}.yaml"
    assert main(["export", str(job), "--to", to, "-o", str(out), *args]) == 0
    text = out.read_text()
    assert SECRET_VALUE not in text
    return [d for d in yaml.safe_load_all(text) if d]


def assert_valid(validator: jsonschema.Draft7Validator, obj: dict) -> None:
    errors = sorted(validator.iter_errors(obj), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


@pytest.mark.parametrize("nodes", ["1", "3"])
def test_pytorchjob_is_valid_and_carries_the_job(tmp_path, nodes):
    docs = export(tmp_path, write_job(tmp_path), "k8s", "--nodes", nodes)
    cm, job = docs
    assert_valid(PYTORCHJOB, job)
    assert job["kind"] == "PyTorchJob" and job["metadata"]["name"] == "support-lora"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {"replicas": 0})["replicas"] == int(nodes) - 1
    assert job["spec"]["nprocPerNode"] == "4"
    assert job["spec"]["runPolicy"]["backoffLimit"] == 2
    for replica in specs.values():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == DIGEST
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        env = {e["name"]: e for e in c["env"]}
        assert env["NCCL_DEBUG"]["value"] == "WARN"
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "support-lora-secrets", "key": "HF_TOKEN"}}}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "support-lora-shared"
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm" and mounts["/shared/ftb"] == "shared"
        # the run directory's staged files come from the ConfigMap, mounted where the config points
        run_dir = next(p for p, n in mounts.items() if n == "run-files")
        assert c["command"][-2:] == [f"{run_dir}/ftb_llamafactory.py", f"{run_dir}/llamafactory.yaml"]
    staged = yaml.safe_load(cm["data"]["llamafactory.yaml"])
    assert staged["output_dir"] == "output/lora" and "ftb_llamafactory.py" in cm["data"]


def test_trainjob_is_valid_and_carries_the_job(tmp_path):
    _, job = export(tmp_path, write_job(tmp_path), "trainjob", "--nodes", "2", "--pvc", "team-nfs")
    assert_valid(TRAINJOB, job)
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4 and trainer["image"] == DIGEST
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 4
    env = {e["name"]: e for e in trainer["env"]}
    assert "secretKeyRef" in env["HF_TOKEN"]["valueFrom"] and "value" not in env["HF_TOKEN"]
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["shared"]["persistentVolumeClaim"]["claimName"] == "team-nfs"


def test_cpu_job_requests_no_gpu_and_no_restarts_means_never(tmp_path):
    job = write_job(tmp_path, restarts=0, use_cpu=True, runtime={"kind": "docker", "image": DIGEST})
    _, pj = export(tmp_path, job, "k8s", "--nodes", "2")
    assert_valid(PYTORCHJOB, pj)
    for replica in pj["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "Never"
        assert "resources" not in replica["template"]["spec"]["containers"][0]
    assert pj["spec"]["runPolicy"]["backoffLimit"] == 0
    _, tj = export(tmp_path, job, "trainjob", "--nodes", "2")
    assert_valid(TRAINJOB, tj)
    assert "resourcesPerNode" not in tj["spec"]["trainer"]


def test_the_schemas_do_reject_a_broken_manifest(tmp_path):
    """The validation can fail: a wrong type and a missing runtimeRef are caught."""
    _, pj = export(tmp_path, write_job(tmp_path), "k8s", "--nodes", "2")
    pj["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    assert list(PYTORCHJOB.iter_errors(pj))
    _, tj = export(tmp_path, write_job(tmp_path), "trainjob", "--nodes", "2")
    del tj["spec"]["runtimeRef"]
    assert list(TRAINJOB.iter_errors(tj))


def test_configmap_is_a_valid_core_object(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    cm, _ = export(tmp_path, write_job(tmp_path), "k8s", "--nodes", "2")
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(cm, version, strict=True)
    broken = {**cm, "data": {"llamafactory.yaml": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_tagged_image_is_refused(tmp_path, capsys):
    job = write_job(tmp_path, runtime={"kind": "host"})
    assert main(["export", str(job), "--to", "k8s", "--image", "llamafactory:latest"]) == 2
    err = capsys.readouterr().err
    assert "--image" in err and "not pinned by digest" in err
    assert main(["export", str(job), "--to", "k8s"]) == 2  # a pod needs an image
    assert "runtime.image" in capsys.readouterr().err
    job = write_job(tmp_path, runtime={"kind": "docker", "image": "llamafactory:0.9.5"})
    assert main(["export", str(job), "--to", "trainjob"]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "runtime.image" in err and "not pinned by digest" in err
    assert not list(tmp_path.glob("out-*"))
