"""The job file: every user mistake is a UserError naming file, key and what is valid."""

from pathlib import Path

import pytest

from ftbundle.errors import UserError
from ftbundle.job import load_job


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


MINIMAL = "name: j\ntrain:\n  command: 'true'\n"


def test_minimal_job_defaults(tmp_path):
    job = load_job(write(tmp_path, MINIMAL))
    assert job.name == "j"
    assert job.hosts == "all"
    assert job.nproc_per_node == 1
    assert job.master_port == 29500
    assert job.runtime.kind == "host"
    assert job.train.mode == "command" and job.train.command == "true"
    assert job.restarts == 0 and job.check is True


def test_issue_example_shape_loads(tmp_path):
    (tmp_path / "inventory").mkdir()
    (tmp_path / "examples/quickstart").mkdir(parents=True)
    (tmp_path / "examples/quickstart/train.yaml").write_text("model_name_or_path: org/model\nstage: sft\noutput_dir: /shared/out\n")
    job = load_job(write(tmp_path, """
name: support-lora
inventory: inventory/hosts.yml
hosts: trainers
nproc_per_node: 2
master_port: 29500
shared_dir: /shared/ftbundle
env:
  GLOO_SOCKET_IFNAME: eth0
runtime:
  kind: host
  python: /opt/ftbundle/venv/bin/python
train:
  llamafactory: examples/quickstart/train.yaml
"""))
    assert job.inventory == tmp_path / "inventory/hosts.yml"
    assert job.hosts == "trainers"
    assert job.env == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert job.train.llamafactory == {"model_name_or_path": "org/model", "stage": "sft", "output_dir": "/shared/out"}
    assert job.runtime.python == "/opt/ftbundle/venv/bin/python"


def test_env_values_become_strings(tmp_path):
    job = load_job(write(tmp_path, MINIMAL + "env:\n  A: 1\n  B: true\n  C: 0.5\n"))
    assert job.env == {"A": "1", "B": "true", "C": "0.5"}


def test_inline_llamafactory_config(tmp_path):
    job = load_job(write(tmp_path, "name: j\ntrain:\n  llamafactory:\n    model_name_or_path: org/model\n    stage: sft\n    lora_rank: 8\n"))
    assert job.train.mode == "llamafactory"
    assert job.train.llamafactory == {"model_name_or_path": "org/model", "stage": "sft", "lora_rank": 8}


def test_script_mode_with_args(tmp_path):
    job = load_job(write(tmp_path, "name: j\ntrain:\n  script: train.py\n  args: [--epochs, 3]\n"))
    assert job.train.script == "train.py" and job.train.args == ("--epochs", "3")


@pytest.mark.parametrize(
    "text, key, fragment",
    [
        ("name: j\ntrain: {command: x}\nnproc_per_nod: 2\n", "nproc_per_nod", "did you mean 'nproc_per_node'"),
        ("name: j\ntrain: {command: x}\nmaster_port: 70000\n", "master_port", "between 1 and 65535"),
        ("name: j\ntrain: {command: x}\nmaster_port: '29500'\n", "master_port", "must be an integer"),
        ("name: j\ntrain: {command: x}\nnproc_per_node: 0\n", "nproc_per_node", "between 1 and"),
        ("name: j\ntrain: {command: x}\nnproc_per_node: many\n", "nproc_per_node", "must be an integer"),
        ("train: {command: x}\n", "name", "is required"),
        ("name: 'bad name!'\ntrain: {command: x}\n", "name", "letters, digits"),
        ("name: j\n", "train", "is required"),
        ("name: j\ntrain: {command: x, script: y.py}\n", "train", "exactly one"),
        ("name: j\ntrain: {comand: x}\n", "train.comand", "did you mean 'command'"),
        ("name: j\ntrain: {llamafactory: missing.yaml}\n", "train.llamafactory", "not found"),
        ("name: j\ntrain: {command: x}\nruntime: {kind: podman}\n", "runtime.kind", "'host' or 'docker'"),
        ("name: j\ntrain: {command: x}\nruntime: {kind: docker, image: 'reg/train:latest'}\n",
         "runtime.image", "not pinned by digest"),
        ("name: j\ntrain: {command: x}\nruntime: {kind: host, gpus: all}\n", "runtime.gpus", "only applies"),
        ("name: j\ntrain: {command: x}\nenv: {1BAD: x}\n", "env.1BAD", "not a valid environment"),
        ("name: j\ntrain: {command: x}\nenv: [A, B]\n", "env", "mapping"),
        ("name: j\ntrain: {command: x}\nenv: {A: \"x\\0y\"}\n", "env.A", "NUL byte"),
        ("name: j\ntrain: {command: x}\nrestarts: -1\n", "restarts", "between 0"),
        ("name: j\ntrain: {command: x, args: [a]}\n", "train.args", "only applies to 'script'"),
    ],
)
def test_bad_input_names_file_and_key(tmp_path, text, key, fragment):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as info:
        load_job(path)
    err = info.value
    assert err.key == key
    assert str(path) in str(err)
    assert fragment in str(err)


def test_unknown_key_error_has_line_number(tmp_path):
    path = write(tmp_path, "name: j\ntrain:\n  command: x\n\nmaster_prot: 1\n")
    with pytest.raises(UserError) as info:
        load_job(path)
    assert f"{path}:5" in str(info.value)
    assert "did you mean 'master_port'" in str(info.value)


def test_malformed_yaml_reports_line_and_column(tmp_path):
    path = write(tmp_path, "name: j\ntrain:\n  command: [unclosed\nenv: {}\n")
    with pytest.raises(UserError) as info:
        load_job(path)
    message = str(info.value)
    assert "malformed YAML" in message
    assert str(path) + ":" in message
    # line:column are both present after the file name
    location = message.split(str(path) + ":", 1)[1].split(":")
    assert location[0].isdigit() and location[1].isdigit()


def test_missing_job_file(tmp_path):
    with pytest.raises(UserError, match="job file not found"):
        load_job(tmp_path / "nope.yaml")


def test_docker_image_pinned_by_digest_or_image_id(tmp_path):
    digest = "0123456789abcdef" * 4
    for image in (f"registry.local/train@sha256:{digest}", f"sha256:{digest}"):
        job = load_job(write(tmp_path, MINIMAL + f"runtime: {{kind: docker, image: '{image}'}}\n"))
        assert job.runtime.image == image
    for image in ("registry.local/train:v1", f"registry.local/train:sha256-{digest}", f"sha256:{digest[:-1]}"):
        with pytest.raises(UserError, match="not pinned by digest"):
            load_job(write(tmp_path, MINIMAL + f"runtime: {{kind: docker, image: '{image}'}}\n"))
