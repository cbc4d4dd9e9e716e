"""Bad input on a real cluster: `ftbundle run` exits 2 with a message naming the file and
the key, and nothing is started (or changed) on any host.

Each case is one job or inventory mistake. "Nothing started" is checked on the hosts
themselves: no run directory and no file at all in the shared storage, no job process,
and for mistakes that are found before any host is asked (all but the missing dataset,
which only the hosts can see), not even an SSH login (sshd's own log says).
"""

from __future__ import annotations

import os
import sys
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import Cluster
from tests.support.helpers import base_job, ftbundle, job_processes, logins, write_job

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(testhost_image):
    shared = Path(tempfile.mkdtemp(prefix="ftb-badinput-", dir="/tmp"))
    c = Cluster(2, shared_dir=shared, image=testhost_image).up()
    yield c
    c.down()
    shutil.rmtree(shared, ignore_errors=True)


def lf_config(tmp_path: Path, **extra) -> dict:
    return {"model_name_or_path": "org/model", "stage": "sft", "do_train": True, "finetuning_type": "lora", "dataset": "support",
            "dataset_dir": "data", "template": "default", "output_dir": "output/x", "save_total_limit": 1,
            **extra}


def good_job(cluster, tmp_path: Path, **extra) -> dict:
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    return base_job("bad", cluster.shared_dir, inventory, {"command": "touch $FTB_RUN_DIR/started"}, **extra)


def case_malformed_yaml(cluster, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: bad\ntrain:\n  command: [unclosed\nenv: {}\n")
    # (libyaml's words: "did not find expected ',' or ']'")
    return path, [f"{path}:4:4: malformed YAML: ", "expected ',' or ']'"]


def case_unknown_key(cluster, tmp_path):
    job = good_job(cluster, tmp_path)
    job["nproc_per_nod"] = 2
    path = write_job(tmp_path / "job.yaml", job)
    return path, [f"{path}:", "key 'nproc_per_nod'", "did you mean 'nproc_per_node'"]


def case_wrong_type(cluster, tmp_path):
    path = write_job(tmp_path / "job.yaml", good_job(cluster, tmp_path, env=["GLOO_SOCKET_IFNAME=eth0"]))
    return path, [f"{path}:", "key 'env'", "must be a mapping of NAME: value"]


def case_pattern_matching_nothing(cluster, tmp_path):
    job = good_job(cluster, tmp_path)
    job["hosts"] = "trainerz"
    path = write_job(tmp_path / "job.yaml", job)
    return path, [str(tmp_path / "hosts.yml"), "key 'hosts'", "'trainerz' matches no host", "trainers"]


def case_two_hosts_one_address(cluster, tmp_path):
    job = good_job(cluster, tmp_path)
    inventory = yaml.safe_load(Path(job["inventory"]).read_text())
    hosts = inventory["all"]["children"]["trainers"]["hosts"]
    hosts["node1"]["ansible_host"] = hosts["node0"]["ansible_host"]
    Path(job["inventory"]).write_text(yaml.safe_dump(inventory))
    path = write_job(tmp_path / "job.yaml", job)
    return path, ["key 'ansible_host'", "node0 and node1 have the same address", cluster.hosts[0].ip]


def case_port_out_of_range(cluster, tmp_path):
    path = write_job(tmp_path / "job.yaml", good_job(cluster, tmp_path, master_port=70000))
    return path, [f"{path}:", "key 'master_port'", "must be between 1 and 65535, got 70000"]


def case_nproc_below_one(cluster, tmp_path):
    path = write_job(tmp_path / "job.yaml", good_job(cluster, tmp_path, nproc_per_node=0))
    return path, [f"{path}:", "key 'nproc_per_node'", "must be between 1 and 1024, got 0"]


def case_missing_llamafactory_config(cluster, tmp_path):
    job = good_job(cluster, tmp_path)
    job["train"] = {"llamafactory": "configs/lora.yaml"}
    path = write_job(tmp_path / "job.yaml", job)
    return path, [f"{path}:", "key 'train.llamafactory'", f"LlamaFactory config not found: {tmp_path}/configs/lora.yaml"]


def case_missing_dataset(cluster, tmp_path):
    """The config is fine, but its dataset file is on no host: only the hosts can tell."""
    data = cluster.shared_dir / "data"
    data.mkdir(exist_ok=True)
    (data / "dataset_info.json").write_text('{"support": {"file_name": "support.json"}}')
    job = good_job(cluster, tmp_path, workdir=str(cluster.shared_dir))
    job["train"] = {"llamafactory": lf_config(tmp_path)}
    path = write_job(tmp_path / "job.yaml", job)
    # (the datasets are on shared storage, the workdir: rank 0 alone reads them, and says so)
    return path, [f"{path}: key 'check'", "nothing was started",
                  f"node0: {data}/support.json missing (needed for dataset 'support')",
                  "the datasets are on shared storage: read once, by node0"]


def case_script_missing_on_the_hosts(cluster, tmp_path):
    """It started, then every rank said `can't open file` (and the summary said exit 2, ftbundle 1)."""
    job = good_job(cluster, tmp_path)
    job["train"] = {"script": f"{cluster.shared_dir}/train.py"}
    path = write_job(tmp_path / "job.yaml", job)
    return path, [f"{path}: key 'check'", "nothing was started",
                  f"train.script {cluster.shared_dir}/train.py on node[0-1]: No such file or directory"]


def case_interpreter_without_torch(cluster, tmp_path):
    """The check printed `torch=absent` and then `all 5 checks passed`."""
    job = good_job(cluster, tmp_path, runtime={"kind": "host", "python": "/usr/bin/python3"})
    job["train"] = {"script": "/usr/bin/true"}
    path = write_job(tmp_path / "job.yaml", job)
    return path, [f"{path}: key 'check'", "torch is not installed in /usr/bin/python3 on node[0-1]",
                  "point the job's runtime.python at an interpreter that has them"]


def tracker_job(cluster, tmp_path, report_to, **env) -> Path:
    """A LlamaFactory job reporting to ``report_to``, its workdir on shared storage, ``env`` in
    its env."""
    job = good_job(cluster, tmp_path, workdir=str(cluster.shared_dir))
    job["env"].update(env)
    job["train"] = {"llamafactory": lf_config(tmp_path, report_to=report_to)}
    return write_job(tmp_path / "job.yaml", job)


def case_tracker_not_installed(cluster, tmp_path):
    """report_to: clearml started, loaded the model, tokenized, then every rank stopped at the
    trainer ("ClearMLCallback requires 'clearml' to be installed"): the hosts' interpreter says first."""
    path = tracker_job(cluster, tmp_path, ["tensorboard", "clearml"])
    python = os.path.normpath(sys.executable)
    return path, [f"{path}: key 'check'", "nothing was started",
                  f"clearml (report_to in train.llamafactory (inline)) is not installed in {python} on node[0-1]",
                  "install it in " + python + ", or take it out of report_to"]


def case_wandb_without_a_key(cluster, tmp_path):
    """report_to: wandb, never logged in on the hosts: rank 0 loaded the model, then stopped at
    wandb.init ('No API key configured'). Only rank 0's host logs, and only it is named."""
    path = tracker_job(cluster, tmp_path, "wandb")
    return path, [f"{path}: key 'check'", "nothing was started",
                  "wandb (report_to) has no API key on node0, where rank 0 logs: no WANDB_API_KEY in the job's env, "
                  "its env file or the login environment, no /root/.netrc, and WANDB_MODE is not offline",
                  "`wandb login` there as the user the job runs as"]


def case_mlflow_file_store_not_allowed(cluster, tmp_path):
    """report_to: mlflow with a file store on shared storage (no MLflow server), on MLflow 3.13+
    without MLFLOW_ALLOW_FILE_STORE: rank 0 loaded the model, then stopped at its first log
    ('The filesystem tracking backend ... is in maintenance mode')."""
    store = f"file://{cluster.shared_dir}/mlruns"
    path = tracker_job(cluster, tmp_path, "mlflow", MLFLOW_TRACKING_URI=store)
    return path, [f"{path}: key 'check'", "nothing was started",
                  f"on node0 refuses the file store {store} unless MLFLOW_ALLOW_FILE_STORE is true",
                  "set MLFLOW_ALLOW_FILE_STORE: \"true\" in the job's env"]


def case_mlflow_server_unreachable(cluster, tmp_path):
    """report_to: mlflow with the tracking URI the launcher's own shell uses (localhost): on rank
    0's host nothing listens there, and MLflow's first call fails after its retries, once the
    model is loaded (MLflow 3.17.2 against a closed port: after 4 min 10 s)."""
    path = tracker_job(cluster, tmp_path, "mlflow", MLFLOW_TRACKING_URI="http://localhost:5000")
    return path, [f"{path}: key 'check'", "nothing was started",
                  "mlflow (report_to) cannot reach its tracking server from node0, where rank 0 logs: localhost:5000 "
                  "Connection refused", "localhost there is not the launcher's"]


def case_wandb_server_unreachable(cluster, tmp_path):
    """report_to: wandb with a key, online, to a server rank 0's host cannot resolve (an
    air-gapped cluster): wandb.init gave up after 90 s, once the model was loaded."""
    path = tracker_job(cluster, tmp_path, "wandb", WANDB_API_KEY="k" * 40, WANDB_BASE_URL="https://wandb.invalid")
    return path, [f"{path}: key 'check'", "nothing was started",
                  "wandb (report_to) cannot reach its server from node0, where rank 0 logs: wandb.invalid:443 name "
                  "not resolved", "WANDB_MODE: offline in the job's env"]


def case_more_cpu_ranks_than_cores(cluster, tmp_path):
    """nproc_per_node: 1024 on 2-core hosts with no GPU passed the check."""
    cores = len(os.sched_getaffinity(0))  # what a host container may use: this machine's cores
    path = write_job(tmp_path / "job.yaml", good_job(cluster, tmp_path, nproc_per_node=1024))
    return path, [f"{path}: key 'check'", f"1024 CPU rank(s) on node[0-1], which have {cores} core(s)",
                  f"set nproc_per_node (or ftb_nproc_per_node) to at most {cores}"]


CASES = {
    "malformed-yaml": (case_malformed_yaml, True),
    "unknown-key": (case_unknown_key, True),
    "wrong-type": (case_wrong_type, True),
    "pattern-matching-nothing": (case_pattern_matching_nothing, True),
    "two-hosts-one-address": (case_two_hosts_one_address, True),
    "port-out-of-range": (case_port_out_of_range, True),
    "nproc-below-one": (case_nproc_below_one, True),
    "missing-llamafactory-config": (case_missing_llamafactory_config, True),
    "missing-dataset": (case_missing_dataset, False),
    "script-missing-on-the-hosts": (case_script_missing_on_the_hosts, False),
    "interpreter-without-torch": (case_interpreter_without_torch, False),
    "tracker-not-installed": (case_tracker_not_installed, False),
    "wandb-without-a-key": (case_wandb_without_a_key, False),
    "mlflow-file-store-not-allowed": (case_mlflow_file_store_not_allowed, False),
    "mlflow-server-unreachable": (case_mlflow_server_unreachable, False),
    "wandb-server-unreachable": (case_wandb_server_unreachable, False),
    "more-cpu-ranks-than-cores": (case_more_cpu_ranks_than_cores, False),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_names_file_and_key_and_starts_nothing(cluster, tmp_path, case):
    make, before_any_host = CASES[case]
    path, fragments = make(cluster, tmp_path)
    shared_before = sorted(p.name for p in cluster.shared_dir.iterdir())
    logins_before = logins(cluster)

    proc = ftbundle("run", str(path), timeout=90)

    assert proc.returncode == 2, proc.stderr + proc.stdout
    message = proc.stderr
    assert message.count("ftbundle: error:") == 1, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert "Traceback" not in message
    # nothing started, nothing left: the shared storage is as it was, no job process anywhere
    assert sorted(p.name for p in cluster.shared_dir.iterdir()) == shared_before
    assert not (cluster.shared_dir / "runs").exists()
    assert job_processes(cluster) == {}
    if before_any_host:
        assert logins(cluster) == logins_before, "a host was contacted"
    shutil.rmtree(cluster.shared_dir / "data", ignore_errors=True)
