"""`ftbundle export`: bad input exits 2 naming the file or flag, writing nothing; every
script variant passes shellcheck; the scripts' resume rule is `restarts`' rule."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.export.shell import RESUME_POINT

REPO = Path(__file__).resolve().parent.parent
DIGEST = "registry.example.com:5000/train/lf@sha256:" + "cd" * 32
SECRET = "hf_export_cli_secret_1"


def job_file(tmp_path: Path, **overrides) -> Path:
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "stage": "sft", "finetuning_type": "lora", "output_dir": "out", "save_total_limit": 2}))
    job = {"name": "cli", "nproc_per_node": 2, "shared_dir": "/shared/ftb",
           "env": {"HF_TOKEN": SECRET, "QUOTED": "it's $(not) `run`"},
           "train": {"llamafactory": "train.yaml"}, **overrides}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.fixture(scope="module")
def shellcheck() -> str:
    p = subprocess.run(["bash", str(REPO / ".ci" / "shellcheck.sh")], capture_output=True, text=True, check=True)
    return p.stdout.split()[-1]


@pytest.mark.parametrize("args,where", [
    (["--to", "slrum"], "--to"),
    (["--to", "slurm", "--nodes", "zero"], "--nodes"),
    (["--to", "slurm", "--nodes", "0"], "--nodes"),
    (["--to", "k8s", "--image", "lf:latest"], "--image"),
    (["--to", "slurm", "--partition", "gpu; rm -rf /"], "--partition"),
    (["--to", "slurm", "--container", "singularity"], "--container"),
])
def test_bad_flags_exit_2_and_write_nothing(tmp_path, capsys, args, where):
    out = tmp_path / "out.txt"
    assert main(["export", str(job_file(tmp_path)), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert f"key '{where}'" in err, err
    assert not out.exists()


def test_bad_job_values_name_the_file_and_key(tmp_path, capsys):
    job = job_file(tmp_path, runtime={"kind": "docker", "image": "lf:0.9.5"})
    assert main(["export", str(job), "--to", "slurm"]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "runtime.image" in err and "not pinned by digest" in err
    job = job_file(tmp_path, shared_dir="relative/dir")
    assert main(["export", str(job), "--to", "pbs"]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "'shared_dir'" in err and "absolute" in err
    job = job_file(tmp_path, nproc_per_node="auto")
    assert main(["export", str(job), "--to", "slurm"]) == 2
    assert "'nproc_per_node'" in capsys.readouterr().err


@pytest.mark.parametrize("variant", [
    ("slurm", {}, []),
    ("slurm", {"runtime": {"kind": "docker", "image": DIGEST, "gpus": "all"}}, ["--container", "pyxis"]),
    ("slurm", {"runtime": {"kind": "docker", "image": DIGEST, "gpus": "all"}}, ["--container", "docker"]),
    ("slurm", {"train": {"command": "echo $NODE_RANK"}}, ["--time", "1:00:00", "--partition", "gpu"]),
    ("pbs", {}, []),
    ("pbs", {"runtime": {"kind": "docker", "image": DIGEST}}, ["--time", "02:00:00"]),
])
def test_every_script_variant_passes_shellcheck(tmp_path, shellcheck, variant):
    to, overrides, args = variant
    out = tmp_path / "job.sh"
    assert main(["export", str(job_file(tmp_path, **overrides)), "--to", to, "--nodes", "3",
                 "-o", str(out), *args]) == 0
    text = out.read_text()
    assert SECRET not in text and "HF_TOKEN" in text
    subprocess.run([shellcheck, str(out)], check=True)
    if to == "slurm":
        assert "#SBATCH --nodes=3" in text and "#SBATCH --requeue" in text and "USR1@120" in text
    if "pyxis" in args:
        assert "--container-image=registry.example.com:5000#train/lf@sha256:" in text
        assert "docker run --rm" not in text
    if "docker" in args:
        assert "docker run --rm --init" in text and "--container-image" not in text


def test_slurm_gpu_job_asks_for_gpus_per_node(tmp_path):
    job = job_file(tmp_path, runtime={"kind": "docker", "image": DIGEST, "gpus": "all"})
    assert main(["export", str(job), "--to", "slurm", "--nodes", "2", "-o", str(tmp_path / "s")]) == 0
    assert "#SBATCH --gpus-per-node=2" in (tmp_path / "s").read_text()


def test_nodes_default_to_the_inventory_host_count(tmp_path):
    (tmp_path / "hosts.yml").write_text("all:\n  hosts:\n" + "".join(
        f"    h{i}: {{ansible_host: 10.1.0.{i + 1}}}\n" for i in range(5)))
    job = job_file(tmp_path, inventory="hosts.yml")
    assert main(["export", str(job), "--to", "slurm", "-o", str(tmp_path / "s")]) == 0
    assert "#SBATCH --nodes=5" in (tmp_path / "s").read_text()


def test_stdout_without_output_flag(tmp_path, capsys):
    assert main(["export", str(job_file(tmp_path)), "--to", "trainjob", "--image", DIGEST, "--nodes", "2"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert docs[-1]["kind"] == "TrainJob"


@pytest.mark.parametrize("layout,expected", [
    ({}, ""),
    ({"checkpoint-5": True, "checkpoint-10": True}, "checkpoint-10"),
    ({"checkpoint-5": True, "checkpoint-10": False}, "checkpoint-5"),  # died while saving 10
    ({"checkpoint-9": True, "checkpoint-10": True, "checkpoint-x": True}, "checkpoint-10"),
])
def test_resume_point_is_the_rule_of_restarts(tmp_path, layout, expected):
    """The exported scripts' resume point and node.sh's (what `restarts` uses) agree."""
    results = []
    for which in ("export", "node"):
        d = tmp_path / which / "out"
        d.mkdir(parents=True)
        for name, complete in layout.items():
            (d / name).mkdir()
            if complete:
                (d / name / "trainer_state.json").write_text("{}")
        if which == "export":
            argv = ["bash", "-c", "set -euo pipefail\n" + RESUME_POINT + '\nftb_resume_point "$1"', "x", str(d)]
        else:
            argv = ["bash", str(REPO / "ftbundle" / "remote" / "node.sh"), "resume-point", str(d)]
        p = subprocess.run(argv, capture_output=True, text=True, check=True)
        results.append((p.stdout.strip(), sorted(x.name for x in d.iterdir())))
    assert results[0] == results[1]
    assert results[0][0] == expected
