"""`ftbundle export --to k8s / trainjob`: manifests that the Kubeflow CRDs accept, by
their openAPIV3Schema and their CEL rules (tests/support/k8s_validate.py: jsonschema + cel-python,
CRDs vendored under tests/data/k8s-crds), pod templates and the ConfigMap that
Kubernetes' own schema accepts (kubernetes-validate, strict), names that are DNS labels
whatever the job is called, and each pod's GPU/CPU/memory request."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.export.k8s import dns_label
from tests.support.k8s_validate import CRD, DNS_1035_LABEL, pod_spec_errors

DIGEST = "registry.example.com/train/llamafactory@sha256:" + "ab" * 32
SECRET_VALUE = "hf_verysecretvalue123"
PYTORCHJOB = CRD("kubeflow.org_pytorchjobs.yaml")
TRAINJOB = CRD("trainer.kubeflow.org_trainjobs.yaml")


def write_job(tmp_path: Path, *, restarts=2, use_cpu=False, runtime=None, extra="") -> Path:
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": "org/model", "stage": "sft", "do_train": True, "finetuning_type": "lora", "dataset": "support",
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


def assert_valid(crd: CRD, obj: dict) -> None:
    errors = crd.errors(obj)
    assert not errors, "\n".join(errors)
    if obj["kind"] == "PyTorchJob":
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            assert not pod_spec_errors(replica["template"]["spec"])
    else:
        assert not pod_spec_errors(trainjob_pod(obj))


def trainjob_pod(tj: dict) -> dict:
    """The node pod a TrainJob makes: the runtime patch's pod with the trainer's container."""
    pod = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    t = tj["spec"]["trainer"]
    (c,) = pod["containers"]
    return {**pod, "containers": [{**c, "image": t["image"], "command": t["command"], "env": t["env"],
                                   "resources": t["resourcesPerNode"]}]}


@pytest.mark.parametrize("nodes", ["1", "3"])
def test_pytorchjob_is_valid_and_carries_the_job(tmp_path, nodes):
    docs = export(tmp_path, write_job(tmp_path), "k8s", "--nodes", nodes)
    cm, job = docs
    assert_valid(PYTORCHJOB, job)
    base = dns_label("Support_LoRA", 40)
    assert job["kind"] == "PyTorchJob" and job["metadata"]["name"] == base
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {"replicas": 0})["replicas"] == int(nodes) - 1
    assert job["spec"]["nprocPerNode"] == "4"
    # the operator counts pod restarts: 2 restarts of the job = 2 restarts of each pod
    assert job["spec"]["runPolicy"]["backoffLimit"] == 2 * int(nodes)
    for replica in specs.values():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == DIGEST
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 4}, "requests": {"cpu": "16", "memory": "64Gi"}}
        env = {e["name"]: e for e in c["env"]}
        assert env["NCCL_DEBUG"]["value"] == "WARN"
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": f"{base}-secrets", "key": "HF_TOKEN"}}}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == f"{base}-shared"
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
    # a trainer has no workingDir: the command goes there first, so relative paths hold
    assert trainer["command"][:2] == ["bash", "-c"] and 'cd -- "$FTB_WORKDIR"' in trainer["command"][2]
    assert {e["name"]: e.get("value") for e in trainer["env"]}["FTB_WORKDIR"] == "/shared/ftb"
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
        assert "limits" not in replica["template"]["spec"]["containers"][0]["resources"]
    assert pj["spec"]["runPolicy"]["backoffLimit"] == 0
    tj = export(tmp_path, job, "trainjob", "--nodes", "2")[-1]
    assert_valid(TRAINJOB, tj)
    assert "limits" not in tj["spec"]["trainer"]["resourcesPerNode"]


def test_the_schemas_do_reject_a_broken_manifest(tmp_path):
    """The validation can fail: a wrong type and a missing runtimeRef are caught."""
    _, pj = export(tmp_path, write_job(tmp_path), "k8s", "--nodes", "2")
    pj["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    assert PYTORCHJOB.errors(pj)
    _, tj = export(tmp_path, write_job(tmp_path), "trainjob", "--nodes", "2")
    assert TRAINJOB.errors({**tj, "metadata": {"name": "7b-lora"}})  # the CRD's CEL rule on names
    assert TRAINJOB.errors({**tj, "spec": {**tj["spec"], "trainer": {**tj["spec"]["trainer"], "numProcPerNode": 0}}})
    assert TRAINJOB.rules >= 2
    del tj["spec"]["runtimeRef"]
    assert TRAINJOB.errors(tj)
    pod = trainjob_pod(tj)
    assert pod_spec_errors({**pod, "volumes": [{**pod["volumes"][0], "name": "Shared_1"}]})
    assert pod_spec_errors({**pod, "containers": [{**pod["containers"][0], "imagePullPolicy": 3}]})


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


HOSTILE_NAMES = ["7b_LoRA.sft", "UPPER.case_name", "x-", "9", "a" * 63, "a_b", "a.b", "support-lora"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_any_job_name_gives_objects_the_api_server_accepts(tmp_path, name):
    job = write_job(tmp_path)
    job.write_text(job.read_text().replace("name: Support_LoRA", f"name: '{name}'"))
    for to, crd in (("k8s", PYTORCHJOB), ("trainjob", TRAINJOB)):
        cm, obj = export(tmp_path, job, to, "--nodes", "12")
        assert_valid(crd, obj)
        label = obj["metadata"]["name"]
        assert DNS_1035_LABEL.match(label) and len(label) <= 40, label
        # the operators' pods and services (<name>-worker-10, <name>-node-0-0) stay labels
        assert DNS_1035_LABEL.match(f"{label}-worker-10") and len(f"{label}-worker-10") <= 63
        assert cm["metadata"]["name"] == f"{label}-files" and DNS_1035_LABEL.match(cm["metadata"]["name"])
    if name == "support-lora":
        assert label == name  # a name that is already a label is kept
    # stable: the same name, the same label
    assert export(tmp_path, job, "trainjob")[1]["metadata"]["name"] == label


def test_names_that_differ_give_labels_that_differ():
    labels = {dns_label(n, 40) for n in HOSTILE_NAMES + ["A_B", "a__b", "a" * 62 + "b"]}
    assert len(labels) == len(HOSTILE_NAMES) + 3


def test_bad_pvc_or_secret_name_exits_2(tmp_path, capsys):
    job = write_job(tmp_path)
    for flag in ("--pvc", "--secret"):
        out = tmp_path / "out.yaml"
        assert main(["export", str(job), "--to", "k8s", flag, "Team_NFS", "-o", str(out)]) == 2
        assert f"key '{flag}'" in capsys.readouterr().err and not out.exists()


def test_cpu_and_memory_requests_follow_the_options(tmp_path):
    _, pj = export(tmp_path, write_job(tmp_path), "k8s", "--nodes", "2", "--cpus-per-node", "30", "--mem", "200G")
    assert_valid(PYTORCHJOB, pj)
    for replica in pj["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "30",
                                                                                         "memory": "200Gi"}


def test_script_job_requests_a_gpu_per_rank_unless_it_says_zero(tmp_path):
    job = write_job(tmp_path)
    job.write_text(job.read_text().replace("llamafactory: train.yaml", "script: train.py"))
    pj = export(tmp_path, job, "k8s", "--nodes", "2")[-1]
    assert_valid(PYTORCHJOB, pj)
    assert pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"][
        "limits"] == {"nvidia.com/gpu": 4}
    job.write_text(job.read_text() + "gpus_per_node: 0\n")
    tj = export(tmp_path, job, "trainjob", "--nodes", "2")[-1]
    assert_valid(TRAINJOB, tj)
    assert "limits" not in tj["spec"]["trainer"]["resourcesPerNode"]


def test_a_restarted_pod_prunes_a_half_written_checkpoint(tmp_path):
    """The pod command, run here with `true` for torchrun: the incomplete newest checkpoint
    is removed before the trainer starts (the rule of `restarts` on SSH and Slurm)."""
    import subprocess

    job = write_job(tmp_path, restarts=1)
    pj = export(tmp_path, job, "k8s", "--nodes", "2")[-1]
    command = pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["bash", "-c"]
    out = Path("/shared/ftb/output/lora")  # the config's output_dir under the workdir
    local = tmp_path / "out"
    for name, complete in (("checkpoint-5", True), ("checkpoint-10", False)):
        (local / name).mkdir(parents=True)
        if complete:
            (local / name / "trainer_state.json").write_text("{}")
    script = command[2].replace(str(out), str(local))
    subprocess.run(["bash", "-c", script, "ftb-node", "true"], check=True, timeout=30,
                   env={"PATH": "/usr/bin:/bin", "PET_NODE_RANK": "0", "FTB_WORKDIR": str(tmp_path)})
    assert sorted(p.name for p in local.iterdir()) == ["checkpoint-5"]


@pytest.mark.parametrize("to", ["k8s", "trainjob"])
def test_hugging_face_caches_off_the_shared_volume_are_warned_about(tmp_path, capsys, to):
    """A pod's own disk goes with the pod: a cache outside shared_dir (the one volume every
    pod mounts) is downloaded again by every pod on every restart. Warned in the output (and
    the file), never silently written; a cache under shared_dir or a local model says nothing."""
    def warnings_for(model: str, env: dict) -> str:
        (tmp_path / "train.yaml").write_text(yaml.safe_dump({
            "stage": "sft", "do_train": True, "finetuning_type": "lora", "dataset": "support",
            "output_dir": "output/lora", "model_name_or_path": model}))
        job = {"name": "hf", "nproc_per_node": 2, "shared_dir": "/shared/ftb", "env": env,
               "runtime": {"kind": "docker", "image": DIGEST}, "train": {"llamafactory": "train.yaml"}}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        capsys.readouterr()
        export(tmp_path, tmp_path / "job.yaml", to)
        return capsys.readouterr().err

    outside = warnings_for("Qwen/Qwen2.5-7B", {"HF_HOME": "/root/.cache/hf", "HF_DATASETS_CACHE": "/shared/ftb/ds"})
    assert "HF_HOME=/root/.cache/hf is outside shared_dir (/shared/ftb)" in outside, outside
    assert "HF_DATASETS_CACHE" not in outside
    assert "# warning: HF_HOME=/root/.cache/hf" in (tmp_path / f"out-{to}.yaml").read_text()
    unset = warnings_for("Qwen/Qwen2.5-7B", {})
    assert "the model Qwen/Qwen2.5-7B comes from the Hugging Face hub and no HF_HOME is set" in unset, unset
    assert "/shared/ftb/hf" in unset
    assert "HF_HOME" not in warnings_for("Qwen/Qwen2.5-7B", {"HF_HOME": "/shared/ftb/hf"})
    assert "Hugging Face" not in warnings_for("/shared/ftb/models/tiny", {})
    # Slurm and PBS run on the cluster's own hosts, whose home directories outlive a job: nothing said
    assert "no HF_HOME is set" in warnings_for("Qwen/Qwen2.5-7B", {})  # (the job the Slurm export reads)
    out = tmp_path / "job.sbatch"
    capsys.readouterr()
    assert main(["export", str(tmp_path / "job.yaml"), "--to", "slurm", "-o", str(out), "--nodes", "2"]) == 0
    assert "Hugging Face" not in capsys.readouterr().err


@pytest.mark.parametrize("to", ["k8s", "slurm", "pbs"])
def test_a_jobs_stage_is_said_not_exported(tmp_path, capsys, to):
    """`stage:` is ftbundle's own copy to each host: an exported job reads the paths as the
    config names them. Said, never dropped in silence."""
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": "/shared/ftb/models/tiny", "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "dataset": "support", "output_dir": "output/lora"}))
    job = {"name": "st", "nproc_per_node": 2, "shared_dir": "/shared/ftb", "stage": ["model", "dataset"],
           "runtime": {"kind": "docker", "image": DIGEST}, "train": {"llamafactory": "train.yaml"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "job.yaml"), "--to", to, "-o", str(tmp_path / "out"), "--nodes", "2"]) == 0
    err = capsys.readouterr().err
    assert f"warning: stage: (model, dataset) is not exported: the {to} job reads the model and dataset" in err, err
