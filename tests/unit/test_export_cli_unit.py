"""`ftbundle export`: bad input exits 2 naming the file or flag, writing nothing; every
script variant passes shellcheck; the scripts' resume rule is `restarts`' rule."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.export.shell import RESUME_POINT

REPO = Path(__file__).resolve().parents[2]
DIGEST = "registry.example.com:5000/train/lf@sha256:" + "cd" * 32
SECRET = "hf_export_cli_secret_1"


def job_file(tmp_path: Path, **overrides) -> Path:
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": "org/model", "stage": "sft", "finetuning_type": "lora", "output_dir": "out", "save_total_limit": 2}))
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
    (["--to", "slurm", "--cpus-per-node", "0"], "--cpus-per-node"),
    (["--to", "slurm", "--mem", "lots"], "--mem"),
    (["--to", "slurm", "--node-gpus", "-1"], "--node-gpus"),
    (["--to", "pbs", "--launcher", "rsh"], "--launcher"),
    (["--to", "k8s", "--image", DIGEST, "--gres"], "--gres"),
    (["--to", "slurm", "--torque"], "--torque"),
    (["--to", "k8s", "--image", DIGEST, "--pvc", "Team_NFS"], "--pvc"),
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
    ("slurm", {"gpus_per_node": 1}, ["--gres", "--cpus-per-node", "16", "--mem", "64G"]),
    ("pbs", {}, []),
    ("pbs", {"runtime": {"kind": "docker", "image": DIGEST}}, ["--time", "02:00:00"]),
    ("pbs", {"gpus_per_node": 1}, ["--torque", "--launcher", "ssh"]),
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


@pytest.mark.parametrize("value", [-1, "two", 1.5, True, 2000])
def test_bad_gpus_per_node_exits_2_naming_file_and_key(tmp_path, capsys, value):
    job = job_file(tmp_path, gpus_per_node=value)
    out = tmp_path / "out.sh"
    assert main(["export", str(job), "--to", "slurm", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "key 'gpus_per_node'" in err and "'auto' or a whole number" in err, err
    assert not out.exists()


@pytest.mark.parametrize("overrides,to,args,expected", [
    ({}, "slurm", [], ["#SBATCH --gpus-per-node=2", "#SBATCH --exclusive", "#SBATCH --mem=0"]),
    ({"train": {"script": "t.py"}}, "slurm", [], ["#SBATCH --gpus-per-node=2"]),  # a script job asks too
    ({"gpus_per_node": 0}, "slurm", ["--cpus-per-node", "8", "--mem", "32G"],
     ["#SBATCH --cpus-per-task=8", "#SBATCH --mem=32G"]),
    ({"gpus_per_node": 4}, "slurm", ["--gres"], ["#SBATCH --gres=gpu:4"]),
    ({}, "pbs", [], ["#PBS -l select=3:ncpus=2:ngpus=2:mpiprocs=1", "#PBS -l place=scatter:excl", "#PBS -V"]),
    ({}, "pbs", ["--cpus-per-node", "32", "--mem", "100G"],
     ["#PBS -l select=3:ncpus=32:ngpus=2:mem=100gb:mpiprocs=1", "#PBS -l place=scatter\n"]),
    ({}, "pbs", ["--torque"], ["#PBS -l nodes=3:ppn=2:gpus=2", "#PBS -V"]),
    ({"gpus_per_node": 0}, "pbs", ["--torque"], ["#PBS -l nodes=3:ppn=2\n"]),
])
def test_what_each_node_requests(tmp_path, overrides, to, args, expected):
    out = tmp_path / "job.sh"
    assert main(["export", str(job_file(tmp_path, **overrides)), "--to", to, "--nodes", "3", "-o", str(out),
                 *args]) == 0
    text = out.read_text()
    for line in expected:
        assert line in text, text
    if overrides.get("gpus_per_node") == 0:
        directives = [line for line in text.splitlines() if line.startswith(("#SBATCH", "#PBS"))]
        assert not [d for d in directives if "gpu" in d], directives


def test_cpu_llamafactory_config_requests_no_gpu(tmp_path):
    job = job_file(tmp_path)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"model_name_or_path": "org/model", "stage": "sft", "output_dir": "out", "use_cpu": True}))
    assert main(["export", str(job), "--to", "slurm", "-o", str(tmp_path / "s")]) == 0
    assert "--gpus" not in (tmp_path / "s").read_text()


def test_dry_run_shows_the_request_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["export", str(job_file(tmp_path)), "--to", "slurm", "--nodes", "4", "--dry-run", "-o", str(out)]) == 0
    assert "requests 4 node(s) x 2 GPU(s), all cores (exclusive node), all memory per node" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export", str(job_file(tmp_path)), "--to", "k8s", "--image", DIGEST, "--dry-run"]) == 0
    cap = capsys.readouterr()
    assert "2 nvidia.com/gpu (limit), 8 CPU, 32Gi memory (requests)" in cap.err and cap.out == ""


def test_docker_in_an_allocation_gets_only_the_allocated_gpus(tmp_path):
    """The node program, run for real with a `docker` that records its arguments: the GPUs
    are those Slurm named (SLURM_JOB_GPUS, real indices), the env file only where it exists."""
    from ftbundle.export import GPU_DEVICES
    from ftbundle.export.shell import NODE_PROGRAM

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/bash\nprintf "%s\\n" "$@" >> "$ARGS_OUT"\n')
    (bin_dir / "docker").chmod(0o755)
    env_file = tmp_path / "nccl.env"
    argv = ["docker", "run", "--gpus", GPU_DEVICES, f"--env-file={env_file}", "img", "python", "x.py"]
    for present in (False, True):
        if present:
            env_file.write_text("NCCL_DEBUG=INFO\n")
        args_out = tmp_path / f"args-{present}"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGS_OUT": str(args_out), "FTB_WORKDIR": str(tmp_path),
               "FTB_CONTAINER": "c", "NODE_RANK": "0", "MASTER_ADDR": "m", "SLURM_JOB_GPUS": "1,3",
               "CUDA_VISIBLE_DEVICES": "0,1"}
        subprocess.run(["bash", "-c", NODE_PROGRAM, "node", *argv], env=env, check=True, timeout=30)
        seen = args_out.read_text().splitlines()
        assert seen[seen.index("--gpus") + 1] == '"device=1,3"' and "all" not in seen
        assert (f"--env-file={env_file}" in seen) is present
    env.pop("SLURM_JOB_GPUS")
    env.pop("CUDA_VISIBLE_DEVICES")
    p = subprocess.run(["bash", "-c", NODE_PROGRAM, "node", *argv], env=env, capture_output=True, text=True,
                       check=False, timeout=30)
    assert p.returncode == 97 and "GPUs requested, but the scheduler named none" in p.stderr


HOSTILE = "it's \"$(touch PWNED)\" `touch PWNED` ${HOME}\nrm -rf / # \\"


def test_hostile_values_stay_in_their_string_comment_or_scalar(tmp_path, shellcheck):
    """A job file path, env value and work directory with newlines, quotes and $(...):
    the scripts run (with stand-in srun/scontrol/ssh) without running any of it, and pass
    the value through unchanged; the YAML carries it as a scalar; comments stay one line."""
    jobdir = tmp_path / "jobs\n$(touch PWNED)"
    jobdir.mkdir()
    shared = tmp_path / "shared"
    work = shared / "w\n$(touch PWNED)'"
    work.mkdir(parents=True)
    job = job_file(jobdir, env={"HOSTILE": HOSTILE, "API_AUTH": "sekrit-auth", "DB_PASSWD": "sekrit-pw",
                                "TRACKING": "http://ann:sekrit-url@ml:5000"},  # (a URL's password: a secret too)
                   shared_dir=str(shared), workdir=str(work), train={"command": 'printf %s "$HOSTILE" > "$SEEN"'})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun / ssh stand-ins: run the node's part here, once
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    (bin_dir / "ssh").write_text('#!/bin/bash\nshift\nexec "$@"\n')
    # pbsdsh: a task gets the job's environment (-V: the submitter's), not the script's exports
    (bin_dir / "pbsdsh").write_text('#!/bin/bash\n[ "$1 $2 $3" = "-n 0 --" ] || exit 9\nshift 3\n'
                                    'exec env -i PATH="$PATH" SEEN="$SEEN" API_AUTH="$API_AUTH" DB_PASSWD="$DB_PASSWD" '
                                    'TRACKING="$TRACKING" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    for to, args in (("slurm", []), ("pbs", ["--launcher", "ssh"]), ("pbs", [])):
        out = tmp_path / f"job.{to}{len(args)}"
        assert main(["export", str(job), "--to", to, "--nodes", "1", "-o", str(out), *args]) == 0
        text = out.read_text()
        assert "sekrit" not in text and "API_AUTH" in text and "DB_PASSWD" in text and "TRACKING" in text  # names
        subprocess.run([shellcheck, str(out)], check=True)
        for line in text.splitlines()[:text.splitlines().index("set -euo pipefail")]:
            assert line.startswith("#"), line  # nothing before the body is code
        seen = tmp_path / f"seen-{to}{len(args)}"
        nodefile = tmp_path / "nodefile"
        nodefile.write_text("localhost\n")
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SEEN": str(seen), "SLURM_JOB_NUM_NODES": "1",
               "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "1", "PBS_NODEFILE": str(nodefile),
               "SLURM_CPUS_ON_NODE": "2", "API_AUTH": "x", "DB_PASSWD": "y", "TRACKING": "z"}
        p = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        assert seen.read_text() == HOSTILE
        assert not list(tmp_path.rglob("PWNED"))
    for to in ("k8s", "trainjob"):
        out = tmp_path / f"job.{to}.yaml"
        assert main(["export", str(job), "--to", to, "--image", DIGEST, "-o", str(out)]) == 0
        text = out.read_text()
        assert "sekrit" not in text
        head = text.split("\n---")[0].splitlines()
        assert all(line.startswith("#") for line in head), head
        docs = [d for d in yaml.safe_load_all(text) if d]
        env = docs[-1]["spec"]["trainer"]["env"] if to == "trainjob" else \
            docs[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
        env = {e["name"]: e for e in env}
        assert env["HOSTILE"]["value"] == HOSTILE
        assert "secretKeyRef" in env["API_AUTH"]["valueFrom"] and "secretKeyRef" in env["DB_PASSWD"]["valueFrom"]
        assert "secretKeyRef" in env["TRACKING"]["valueFrom"]


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
