"""Issue 10 on containerized hosts: values never become shell, secrets reach no artefact,
GPU facts come from a stand-in nvidia-smi replaying hand-made sample outputs (a hung one included),
the inventory is read as Ansible reads it (templated vars, vault, a bastion), and unknown
host keys are refused unless accepted."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import base_job, ftbundle, install_smi, job_processes, only_run_dir, quickstart_lora, write_job

pytestmark = pytest.mark.cluster

ODD = "a'b \"c\" $(touch /tmp/PWNED) `touch /tmp/PWNED2` d"


@pytest.fixture
def cluster2(make_cluster):
    return make_cluster(2)


def pwned(cluster) -> dict[str, str]:
    return {h.name: out for h in cluster.hosts
            if (out := cluster.exec(h, "ls /tmp/PWNED* 2>/dev/null; ls -d /PWNED* 2>/dev/null", check=False).stdout.strip())}


def test_paths_with_quotes_dollar_and_backticks_are_used_literally(cluster2, tmp_path):
    """shared_dir and workdir holding spaces, both quotes, $(...) and backticks: the check, the
    staging and the run use them as the paths they are, and nothing is executed on any host.
    A job name like that is refused with exit 2 before any host is touched."""
    shared = cluster2.shared_dir / ODD
    workdir = shared / "work dir"
    workdir.mkdir(parents=True)
    inventory = cluster2.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job(
        "odd", shared, inventory, {"command": 'echo "rank $NODE_RANK in $PWD"; ls "$FTB_RUN_DIR" >/dev/null'},
        workdir=str(workdir)))
    result = ftbundle("run", "-v", str(job), timeout=120)  # -v: rank 0's raw output on stdout
    assert result.returncode == 0, result.stderr
    assert "check passed" in result.stderr
    assert f"rank 0 in {workdir}" in result.stdout
    run = only_run_dir(shared)
    assert (run / "node-1-node1.a1.log").read_text().strip() == f"rank 1 in {workdir}"
    assert pwned(cluster2) == {} and not Path("/tmp/PWNED").exists()

    bad = write_job(tmp_path / "bad.yaml", base_job("x$(touch /tmp/PWNED)", shared, inventory, {"command": "true"}))
    result = ftbundle("run", str(bad), timeout=60)
    assert result.returncode == 2 and "key 'name'" in result.stderr
    assert pwned(cluster2) == {}


def test_secrets_reach_no_file_no_terminal_and_no_command_line(cluster2, tmp_path):
    """A LlamaFactory hf_hub_token and an env secret: the ranks get them, but neither appears
    in any file under shared_dir (staged config, plan.json, logs, checkpoints), in ftbundle's
    output, or in any process's command line on the hosts while the job runs."""
    shared = cluster2.shared_dir
    token, env_secret = "hf_Zq8TopSecretTokenValue123", "wandb-SecretValue-987"
    inventory = cluster2.write_inventory(tmp_path / "hosts.yml")
    train = quickstart_lora(shared, max_steps=4, save_steps=2, per_device_train_batch_size=2, hf_hub_token=token)
    job = base_job("secret", shared, inventory, {"llamafactory": train})
    job["env"]["WANDB_API_KEY"] = env_secret
    job_path = write_job(tmp_path / "job.yaml", job)

    seen_in_cmdline: list[str] = []
    samples: list[str] = []  # what the watcher read: proof that it ran, not just that it found nothing
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for h in cluster2.hosts:
                out = cluster2.exec(h, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", check=False).stdout
                seen_in_cmdline.extend(f"{h.name}: {v}" for v in (token, env_secret) if v in out)
                samples.append(out)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = ftbundle("run", str(job_path), timeout=600)
    finally:
        stop.set()
        watcher.join(10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (shared / "output/lora/adapter_model.safetensors").exists()
    assert seen_in_cmdline == []
    # the watcher saw the job itself running (LlamaFactory's entry on the hosts' command lines)
    assert len(samples) >= 4 and any("ftb_llamafactory.py" in out for out in samples), len(samples)
    for value in (token, env_secret):
        assert value not in proc.stdout and value not in proc.stderr
        hits = subprocess.run(["grep", "-rl", "--", value, str(shared)], capture_output=True, text=True).stdout
        assert hits == "", hits
    staged = yaml.safe_load((only_run_dir(shared) / "llamafactory.yaml").read_text())
    assert "hf_hub_token" not in staged
    # the dry run shows neither
    dry = ftbundle("run", str(job_path), "--dry-run", "--no-check")
    assert dry.returncode == 0 and token not in dry.stdout and env_secret not in dry.stdout
    assert "FTB_LF_HF_HUB_TOKEN=<redacted>" in dry.stdout


def test_gpu_facts_from_a_stand_in_nvidia_smi_on_the_hosts(cluster2, tmp_path):
    """A stand-in nvidia-smi on each host replays hand-made sample outputs: `auto` becomes the GPUs the
    job sees (the job's CUDA_VISIBLE_DEVICES counts), the docker runtime gets them by default,
    a leftover process is named with its pid, and a hung driver is reported as a hung driver
    (not as an unreachable host) within the probe's timeout."""
    for h in cluster2.hosts:
        install_smi(cluster2, h, "a100-x4")
    inventory = cluster2.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("gpus", cluster2.shared_dir, inventory, {"script": "train.py"},
                                                     nproc_per_node="auto"))
    dry = ftbundle("run", str(job), "--dry-run", timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "world size 8 = 2 node(s) x 4 rank(s)" in dry.stdout and "--nproc_per_node 4" in dry.stdout

    image = "reg/train@sha256:" + "a" * 64
    two = write_job(tmp_path / "two.yaml", base_job(
        "gpus", cluster2.shared_dir, inventory, {"script": "train.py"}, nproc_per_node="auto",
        runtime={"kind": "docker", "image": image}, env={"CUDA_VISIBLE_DEVICES": "2,3"}))
    dry = ftbundle("run", str(two), "--dry-run", timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "--gpus '\"device=2,3\"'" in dry.stdout and "--nproc_per_node 2" in dry.stdout

    (cluster2.shared_dir / "train.py").write_text("")  # the job's script, where the check looks for it
    check = ftbundle("check", str(job), timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "4x NVIDIA A100-SXM4-80GB (81920 MiB, compute 8.0, driver 535.104.05): node[0-1]" in check.stdout
    assert "WARN node0: GPUs in use by pid 48213 (/opt/venv/bin/python3, 30712 MiB)" in check.stdout

    install_smi(cluster2, "node1", "hang")
    started = time.monotonic()
    check = ftbundle("check", str(job), timeout=120)
    took = time.monotonic() - started
    assert check.returncode == 2
    assert "node1: GPU driver hung: nvidia-smi did not answer within 10s" in check.stdout
    assert "cannot SSH" not in check.stdout and "ssh         reachable: node[0-1]" in check.stdout
    assert took < 40, took
    assert job_processes(cluster2) == {}


def test_inventory_templated_vault_and_a_bastion(make_cluster, tmp_path):
    """Host vars are templated as Ansible templates them, vaulted group_vars decrypt with
    --vault-password-file, and hosts the controller cannot reach directly are reached through
    `-o ProxyJump=` (a bastion), all with one login per host."""
    cluster = make_cluster(3)
    bastion, targets = cluster.hosts[0], cluster.hosts[1:]
    gateway = cluster.exec(targets[0], "ip -o route show default | awk '{print $3}'").stdout.strip()
    for h in targets:  # the controller (the network's gateway) may not reach sshd directly
        cluster.exec(h, "nft add table inet ftbtest && nft add chain inet ftbtest in "
                        "'{ type filter hook input priority 0; }' && "
                        f"nft add rule inet ftbtest in ip saddr {gateway} tcp dport 22 drop")
    direct = subprocess.run(cluster.ssh_argv(targets[0]) + ["-o", "ConnectTimeout=3", "true"], capture_output=True)
    assert direct.returncode != 0  # really unreachable without the bastion

    inv_dir = tmp_path / "inv"
    base = cluster.write_inventory(inv_dir / "hosts.yml", per_host={
        h.name: {"ansible_ssh_common_args": f"-o UserKnownHostsFile={cluster.known_hosts} "
                                            f"-o ProxyJump=root@{bastion.ip}"} for h in targets})
    data = yaml.safe_load(base.read_text())
    data["all"]["children"]["trainers"]["hosts"].pop(bastion.name)
    base.write_text(yaml.safe_dump(data))
    password = tmp_path / "vault-pass"
    password.write_text("s3cret-vault-pw\n")
    vaulted = subprocess.run([str(Path(sys.executable).parent / "ansible-vault"), "encrypt_string",
                              "--vault-password-file", str(password), "--name", "ftb_vaulted_ip",
                              targets[0].ip], capture_output=True, text=True, check=True).stdout
    (inv_dir / "group_vars").mkdir()
    # the master address: a template over a vaulted value
    (inv_dir / "group_vars" / "trainers.yml").write_text(vaulted + 'ftb_master_addr: "{{ ftb_vaulted_ip }}"\n')
    job = write_job(tmp_path / "job.yaml", base_job(
        "bastion", cluster.shared_dir, base, {"command": 'echo "rank $NODE_RANK master $MASTER_ADDR"'}))

    no_pw = ftbundle("run", str(job), "--dry-run", env={**os.environ, "ANSIBLE_VAULT_PASSWORD_FILE": ""})
    assert no_pw.returncode == 2 and "vault" in no_pw.stderr.lower(), no_pw.stderr

    result = ftbundle("run", "-v", str(job), "--vault-password-file", str(password), timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"rank 0 master {targets[0].ip}" in result.stdout  # templated from the vaulted value
    run = only_run_dir(cluster.shared_dir)
    assert f"rank 1 master {targets[0].ip}" in (run / f"node-1-{targets[1].name}.a1.log").read_text()


def test_unknown_host_keys_are_refused_unless_accepted(cluster2, tmp_path):
    """No known_hosts entry: refused as OpenSSH refuses it, with how to accept; accepted and
    recorded with --accept-new-host-keys; known from then on."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    inventory = cluster2.write_inventory(tmp_path / "hosts.yml", hostvars={"ansible_ssh_common_args": ""})
    job = write_job(tmp_path / "job.yaml", base_job("keys", cluster2.shared_dir, inventory, {"command": "true"}))
    refused = ftbundle("check", str(job), env=env, timeout=60)
    assert refused.returncode == 2
    assert "is not in known_hosts: refused" in refused.stdout and "--accept-new-host-keys" in refused.stdout
    assert not (home / ".ssh" / "known_hosts").exists()
    accepted = ftbundle("check", str(job), "--accept-new-host-keys", env=env, timeout=60)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "accepted the new host key of" in accepted.stderr
    recorded = (home / ".ssh" / "known_hosts").read_text()
    assert all(h.ip in recorded for h in cluster2.hosts)
    again = ftbundle("check", str(job), env=env, timeout=60)
    assert again.returncode == 0 and "accepted the new host key" not in again.stderr
