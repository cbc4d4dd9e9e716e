"""The pure core: (job, inventory) -> plan. Real Ansible inventory parsing, no hosts."""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from ftbundle.errors import UserError
from ftbundle.inventory import Host, load_hosts, localhost_only
from ftbundle.job import load_job
from tests.support.helpers import free_port, marked_pids
from tests.support.helpers import plan_of as make_plan

INVENTORY = """
all:
  children:
    trainers:
      hosts:
        gpu-a: {ansible_host: 10.9.0.11, ansible_user: train, ansible_port: 2222}
        gpu-b: {ansible_host: 10.9.0.12, ansible_user: train, ansible_ssh_private_key_file: /keys/id}
        gpu-c: {ansible_host: 10.9.0.13, ansible_user: train}
      vars:
        ftb_shared_dir: /shared
    storage:
      hosts:
        nfs-1: {ansible_host: 10.9.0.2}
"""


@pytest.fixture
def inventory(tmp_path) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(INVENTORY)
    return path


def job_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(body)
    return path


def plan_for(tmp_path, inventory, body, pattern="trainers", run_id="r1"):
    job = load_job(job_file(tmp_path, body))
    hosts = load_hosts(inventory, pattern)
    return make_plan(job, hosts, run_id)


COMMAND_JOB = "name: j\nhosts: trainers\nnproc_per_node: 4\ntrain:\n  command: bash finetune_lora_ds.sh\n"


def test_hosts_from_ansible_inventory_in_order(inventory):
    hosts = load_hosts(inventory, "trainers")
    assert [h.name for h in hosts] == ["gpu-a", "gpu-b", "gpu-c"]
    a, b, _ = hosts
    assert (a.address, a.port, a.user) == ("10.9.0.11", 2222, "train")
    assert b.key_file == "/keys/id" and b.port == 22
    assert a.vars["ftb_shared_dir"] == "/shared"  # group_vars reach the host
    assert not any(h.local for h in hosts)


def test_patterns_select_hosts(inventory):
    assert [h.name for h in load_hosts(inventory, "all")] == ["gpu-a", "gpu-b", "gpu-c", "nfs-1"]
    assert [h.name for h in load_hosts(inventory, "trainers:!gpu-b")] == ["gpu-a", "gpu-c"]
    assert [h.name for h in load_hosts(inventory, "gpu-*")] == ["gpu-a", "gpu-b", "gpu-c"]


def test_pattern_matching_nothing_is_a_user_error(inventory):
    with pytest.raises(UserError) as info:
        load_hosts(inventory, "trainerz")
    assert "matches no host" in str(info.value) and "trainers" in str(info.value)
    assert info.value.key == "hosts"


def test_ftb_node_rank_overrides_inventory_order(tmp_path):
    path = tmp_path / "inv.yml"
    path.write_text("all:\n  hosts:\n    x: {ftb_node_rank: 2}\n    y: {ftb_node_rank: 0}\n    z: {ftb_node_rank: 1}\n")
    assert [h.name for h in load_hosts(path)] == ["y", "z", "x"]


@pytest.mark.parametrize("ranks, fragment", [
    ({"x": 0, "y": 0}, "0..1 once each"),
    ({"x": 0}, "not on: y"),
    ({"x": 0, "y": 5}, "0..1 once each"),
])
def test_bad_ftb_node_rank(tmp_path, ranks, fragment):
    lines = ["all:", "  hosts:"]
    for name in ("x", "y"):
        lines.append(f"    {name}: {{ftb_node_rank: {ranks[name]}}}" if name in ranks else f"    {name}: {{}}")
    path = tmp_path / "inv.yml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=fragment):
        load_hosts(path)


def test_rank_vars_for_every_host(tmp_path, inventory):
    plan = plan_for(tmp_path, inventory, COMMAND_JOB)
    assert plan.nnodes == 3 and plan.world_size == 12
    assert plan.master_addr == "10.9.0.11"
    for rank, node in enumerate(plan.nodes):
        assert node.rank == rank
        assert node.env["NODE_RANK"] == str(rank)
        assert node.env["NNODES"] == "3"
        assert node.env["MASTER_ADDR"] == "10.9.0.11"
        assert node.env["MASTER_PORT"] == "29500"
        assert node.env["NPROC_PER_NODE"] == "4"
        assert node.env["FTB_RUN_ID"] == "r1"
        assert node.log_path == f"/shared/runs/r1/node-{rank}-{node.host.name}.a1.log"
        assert node.stream is (rank == 0)
    assert plan.nodes[0].argv == ("bash", "-c", "bash finetune_lora_ds.sh")


def test_master_addr_override_for_a_private_fabric(tmp_path, inventory):
    text = INVENTORY.replace("ansible_port: 2222}", "ansible_port: 2222, ftb_master_addr: 192.168.100.1}")
    inventory.write_text(text)
    plan = plan_for(tmp_path, inventory, COMMAND_JOB)
    assert {n.env["MASTER_ADDR"] for n in plan.nodes} == {"192.168.100.1"}


def test_llamafactory_mode_runs_torchrun_with_staged_config(tmp_path, inventory):
    (tmp_path / "train.yaml").write_text("model_name_or_path: org/model\nstage: sft\noutput_dir: /shared/out\n")
    plan = plan_for(tmp_path, inventory, "name: j\nhosts: trainers\nnproc_per_node: 2\n"
                    "runtime: {python: /opt/venv/bin/python}\ntrain: {llamafactory: train.yaml}\n")
    node1 = plan.nodes[1]
    assert list(node1.argv) == [
        "/opt/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "3", "--nproc_per_node", "2",
        "--node_rank", "1", "--master_addr", "10.9.0.11", "--master_port", "29500",
        "--log-dir", "/shared/runs/r1/ranks/node-1", "--redirects", "1:3",
        "/shared/runs/r1/ftb_llamafactory.py", "/shared/runs/r1/llamafactory.yaml",
    ]
    assert "llamafactory.launcher" in plan.files["ftb_llamafactory.py"]
    assert node1.path_prepend == "/opt/venv/bin"
    assert yaml.safe_load(plan.files["llamafactory.yaml"]) == {"model_name_or_path": "org/model", "stage": "sft",
                                                               "output_dir": "/shared/out",
                                                               "include_num_input_tokens_seen": True}
    assert node1.workdir == "/shared"  # remote hosts default to the shared directory


def test_the_plan_keeps_whether_output_dir_is_shared_for_status_with_rank_0s_host_down(tmp_path, inventory):
    """`status` reads output_dir's checkpoints through another host only where every host has them
    (runs.py _training): plan.json says so (without the check's probe: whether it is under shared_dir)."""
    job = "name: j\nhosts: trainers\ntrain: {llamafactory: train.yaml}\n"
    for output_dir, shared in (("/shared/out", True), ("/scratch/out", False)):
        (tmp_path / "train.yaml").write_text(f"model_name_or_path: org/model\nstage: sft\noutput_dir: {output_dir}\n")
        plan = plan_for(tmp_path, inventory, job)
        assert (plan.checkpoint_shared, plan.to_dict()["checkpoint_shared"]) == (shared, shared), output_dir
    assert plan_for(tmp_path, inventory, COMMAND_JOB).to_dict()["checkpoint_shared"] is None


def test_script_mode(tmp_path, inventory):
    plan = plan_for(tmp_path, inventory, "name: j\nhosts: trainers\nshared_dir: /mnt/nfs\nworkdir: /mnt/nfs/code\n"
                    "train: {script: train.py, args: [--lr, '0.1']}\n")
    node = plan.nodes[2]
    assert node.argv[:3] == ("python3", "-m", "torch.distributed.run")
    assert node.argv[-3:] == ("train.py", "--lr", "0.1")
    assert "--node_rank" in node.argv and node.argv[node.argv.index("--node_rank") + 1] == "2"
    assert node.workdir == "/mnt/nfs/code"
    assert plan.run_dir == "/mnt/nfs/runs/r1"


def test_job_env_reaches_every_node_but_cannot_override_rank_vars(tmp_path, inventory):
    plan = plan_for(tmp_path, inventory, COMMAND_JOB + "env: {GLOO_SOCKET_IFNAME: eth0}\n")
    assert all(n.env["GLOO_SOCKET_IFNAME"] == "eth0" for n in plan.nodes)
    with pytest.raises(UserError, match="NODE_RANK is set by ftbundle"):
        plan_for(tmp_path, inventory, COMMAND_JOB + "env: {NODE_RANK: 3}\n")


def test_docker_runtime_command(tmp_path, inventory):
    digest = "reg.local/train@sha256:" + "a" * 64
    plan = plan_for(tmp_path, inventory, f"""
name: j
hosts: trainers
nproc_per_node: 8
env: {{HF_TOKEN: hunter2}}
runtime: {{kind: docker, image: '{digest}', gpus: all}}
train: {{script: train.py}}
""")
    argv = list(plan.nodes[1].argv)
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[argv.index("--name") + 1] == "ftb-r1-1"
    assert argv[argv.index("--network") + 1] == "host"
    assert argv[argv.index("--ipc") + 1] == "host"
    assert argv[argv.index("--gpus") + 1] == "all"
    assert "/shared:/shared" in argv
    assert argv[argv.index("--env-file") + 1] == "/etc/ftbundle/nccl.env"
    # the environment goes by name only: no value (no secret) on the command line
    assert "HF_TOKEN" in argv and "hunter2" not in " ".join(argv)
    assert "NODE_RANK" in argv
    image_at = argv.index(digest)
    assert argv[image_at + 1:image_at + 4] == ["python3", "-m", "torch.distributed.run"]
    assert plan.nodes[1].stop_argv == ("docker", "rm", "-f", "ftb-r1-1")


def test_docker_image_from_inventory_or_from_what_site_yml_recorded(tmp_path, inventory):
    """A pinned ftb_image is used as it is; a tagged one is what site.yml resolved and
    recorded on every host (/etc/ftbundle/image.ref): the plan takes that digest from the
    hosts' facts, refuses without them, and refuses a record that differs between hosts."""
    from ftbundle.facts import ClusterFacts, HostFacts

    job = "name: j\nhosts: trainers\nruntime: {kind: docker}\ntrain: {script: t.py}\n"
    inventory.write_text(INVENTORY.replace("ftb_shared_dir: /shared", "ftb_shared_dir: /shared\n        ftb_image: reg/train:v1"))
    with pytest.raises(UserError, match="site.yml recorded on the hosts") as info:
        plan_for(tmp_path, inventory, job)
    assert info.value.key == "runtime.image"
    recorded = "reg/train@sha256:" + "c" * 64
    hosts = load_hosts(inventory, "trainers")
    facts = ClusterFacts([HostFacts(h.name, r, image_ref=recorded) for r, h in enumerate(hosts)])
    plan = make_plan(load_job(job_file(tmp_path, job)), hosts, "r1", facts)
    assert plan.image == recorded and all(recorded in n.argv for n in plan.nodes)
    facts.hosts[2].image_ref = "reg/train@sha256:" + "d" * 64
    with pytest.raises(UserError, match="recorded different images"):
        make_plan(load_job(job_file(tmp_path, job)), hosts, "r1", facts)
    for f in facts.hosts:
        f.image_ref = "reg/train:v1"
    with pytest.raises(UserError, match="not pinned by digest"):
        make_plan(load_job(job_file(tmp_path, job)), hosts, "r1", facts)
    pinned = "reg/train@sha256:" + "b" * 64
    inventory.write_text(INVENTORY.replace("ftb_shared_dir: /shared", f"ftb_shared_dir: /shared\n        ftb_image: '{pinned}'"))
    plan = plan_for(tmp_path, inventory, job)
    assert pinned in plan.nodes[0].argv


def test_two_hosts_with_the_same_address(tmp_path, inventory):
    inventory.write_text(INVENTORY.replace("10.9.0.13", "10.9.0.12"))
    with pytest.raises(UserError, match="gpu-b and gpu-c have the same address 10.9.0.12"):
        plan_for(tmp_path, inventory, COMMAND_JOB)


def test_remote_hosts_need_an_absolute_shared_dir(tmp_path, inventory):
    inventory.write_text(INVENTORY.replace("ftb_shared_dir: /shared", "ftb_x: 1"))
    with pytest.raises(UserError, match="is required when hosts are remote") as info:
        plan_for(tmp_path, inventory, COMMAND_JOB)
    assert info.value.key == "shared_dir"
    with pytest.raises(UserError, match="must be an absolute path"):
        plan_for(tmp_path, inventory, COMMAND_JOB + "shared_dir: rel/dir\n")


def test_localhost_default(tmp_path):
    job = load_job(job_file(tmp_path, "name: q\nnproc_per_node: 2\nshared_dir: .shared\n"
                                      "runtime: {python: ../venv/bin/python}\ntrain: {command: x}\n"))
    plan = make_plan(job, localhost_only(), "r9")
    node = plan.nodes[0]
    assert node.host.local and plan.master_addr == "127.0.0.1"
    assert plan.run_dir == str(tmp_path / ".shared/runs/r9")
    assert node.workdir == str(tmp_path)
    # a relative interpreter is resolved against the job file; its bin/ leads PATH (torchrun)
    assert node.path_prepend == str(tmp_path.parent / "venv/bin")
    assert plan.nodes[0].env["NNODES"] == "1"


def test_local_rank0_with_remote_peers_needs_master_addr(tmp_path):
    job = load_job(job_file(tmp_path, "name: q\nshared_dir: /s\ntrain: {command: x}\n"))
    hosts = [Host("localhost", "127.0.0.1", local=True, vars={}), Host("b", "10.0.0.2", vars={})]
    with pytest.raises(UserError, match="set ftb_master_addr"):
        make_plan(job, hosts, "r")


def test_plan_file_redacts_secrets(tmp_path, inventory):
    plan = plan_for(tmp_path, inventory, COMMAND_JOB + "env: {HF_TOKEN: hunter2, WANDB_API_KEY: k1, DB_PASSWORD: p, LR: '3'}\n")
    text = json.dumps(plan.to_dict())
    assert "hunter2" not in text and "k1" not in text and '"p"' not in text
    assert plan.to_dict()["nodes"][0]["env"]["LR"] == "3"
    assert plan.to_dict()["nodes"][0]["env"]["HF_TOKEN"] == "<redacted>"


def test_node_program_carries_no_value_and_payload_carries_the_environment(tmp_path, inventory):
    """The node program is fixed text: the job's values (secrets included) travel in the
    stdin payload as NAME=VALUE pairs, never in the command line."""
    import subprocess

    from ftbundle.launch import node as N
    from ftbundle.rundir import NodeFiles

    plan = plan_for(tmp_path, inventory, COMMAND_JOB + "env: {HF_TOKEN: hunter2, ODD: \"a'b $(x) `y`\"}\n")
    node = plan.nodes[0]
    files = NodeFiles.of(plan.run_dir, plan.run_id, 0, node.host.name, 1)
    argv = N.node_argv("node", *node.argv)
    assert "hunter2" not in " ".join(argv) and argv[2] == N.program()
    env = N.node_env(node, plan, files, 1, detach=False)
    payload = N.env_payload(env)
    assert payload.endswith(b"\0\0")
    pairs = payload[:-2].split(b"\0")
    assert b"HF_TOKEN=hunter2" in pairs and b"NODE_RANK=0" in pairs
    assert b"ODD=a'b $(x) `y`" in pairs
    assert b"FTB_ENV_FILE=/etc/ftbundle/nccl.env" in pairs
    assert b"FTB_SECRET_NAMES=HF_TOKEN" in pairs
    assert b"FTB_MARKER=" + files.marker.encode() in pairs and files.marker.endswith(".a1-0")
    assert subprocess.run(["bash", "-n"], input=N.program(), text=True).returncode == 0


def _node_program_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    run = tmp_path / "run"
    return {"FTB_RUN_DIR": str(run), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(run / "n.log"),
            "FTB_EXIT": str(run / "n.exit"), "FTB_PIDFILE": str(run / "n.pid"), "FTB_HBFILE": str(run / "n.hb"),
            "FTB_MARKER": f"test-{os.getpid()}-{tmp_path.name}", "FTB_ATTEMPT": "1", "FTB_HEARTBEAT": "1",
            "FTB_WATCHDOG": "30", "FTB_STOP_GRACE": "1", "FTB_DETACH": "0", **extra}


def test_node_program_exports_the_payload_as_it_is(tmp_path):
    """The real node program (bash, here on this machine) reads the NUL-separated payload
    and the job sees every value byte for byte: newlines, quotes, `=`, `$(...)`, UTF-8."""
    import subprocess

    from ftbundle.launch import node as N

    odd = {"ODD": "a'b \"c\" $(touch PWNED) `x`", "MULTI": "line 1\nline 2\n", "EQ": "k=v=w", "UTF": "é ✓",
           "EMPTY": ""}
    env = _node_program_env(tmp_path, **odd)
    dump = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))" % sorted(odd)
    proc = subprocess.Popen(N.node_argv("node", sys.executable, "-c", dump), stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": os.environ["PATH"]})
    proc.stdin.write(N.env_payload(env) + b"\n")  # the payload, then a ping, in one write
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    proc.stdin.close()
    assert json.loads((tmp_path / "run" / "n.log").read_text()) == odd
    assert (tmp_path / "run" / "n.exit").read_text() == "0\n"
    assert not (tmp_path / "PWNED").exists()


def test_node_program_without_the_whole_payload_runs_nothing(tmp_path):
    """stdin closed before the terminating NUL (a controller gone mid-write): exit 97, and
    the job never ran."""
    import subprocess

    from ftbundle.launch import node as N

    payload = N.env_payload(_node_program_env(tmp_path))
    proc = subprocess.run(N.node_argv("node", "touch", str(tmp_path / "ran")), input=payload[:-1],
                          capture_output=True, env={"PATH": os.environ["PATH"]}, timeout=30)
    assert proc.returncode == 97 and b"no environment on stdin" in proc.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "run").exists()


# a job whose main process ends at SIGTERM (or by itself) while a rank it started ignores SIGTERM
STUBBORN_RANK = "(trap '' TERM; while :; do sleep 0.1; done) & "


def test_node_program_exits_after_its_watchdog_killed_a_stubborn_rank(tmp_path):
    """`stop` on the node channel: the watchdog SIGTERMs the job; its main process ends, a
    rank that ignores SIGTERM lives on. The node program exits only after the watchdog's
    SIGKILL (FTB_STOP_GRACE later), so its exit tells the launcher that nothing is left: the
    teardown needs no second channel per host. (It used to exit with the main process.)"""
    import subprocess
    import time

    from ftbundle.launch import node as N

    env = _node_program_env(tmp_path)
    proc = subprocess.Popen(N.node_argv("node", "bash", "-c", STUBBORN_RANK + "wait"), stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": os.environ["PATH"]})
    try:
        proc.stdin.write(N.env_payload(env))
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while len(marked_pids(env["FTB_MARKER"])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(marked_pids(env["FTB_MARKER"])) >= 2, "the job and its rank never ran"
        stopped = time.monotonic()
        proc.stdin.write(b"stop\n")
        proc.stdin.close()
        proc.wait(timeout=15)
        took = time.monotonic() - stopped
        left = marked_pids(env["FTB_MARKER"])
        assert not left, f"the node program exited with the job's processes {left} still there"
        assert took >= 0.9, f"exited {took:.1f}s after stop: before the 1 s grace was over"
    finally:
        for pid in marked_pids(env["FTB_MARKER"]):
            os.kill(pid, 9)


def test_node_program_takes_a_job_s_leftovers_with_it(tmp_path):
    """The job's main process exits by itself (code 3) and leaves a rank that ignores
    SIGTERM: the node program stops it before it exits, and reports the job's own code."""
    import subprocess

    from ftbundle.launch import node as N

    env = _node_program_env(tmp_path)
    proc = subprocess.Popen(N.node_argv("node", "bash", "-c", STUBBORN_RANK + "sleep 0.5; exit 3"),
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": os.environ["PATH"]})
    try:
        proc.stdin.write(N.env_payload(env))
        proc.stdin.flush()
        assert proc.wait(timeout=15) == 3
        assert not marked_pids(env["FTB_MARKER"]), "a rank of the ended job was left running"
        assert (tmp_path / "run" / "n.exit").read_text() == "3\n"
    finally:
        proc.stdin.close()
        for pid in marked_pids(env["FTB_MARKER"]):
            os.kill(pid, 9)


def test_dry_run_prints_every_host(tmp_path, inventory, capsys):
    from ftbundle.cli import main
    path = job_file(tmp_path, COMMAND_JOB + f"inventory: {inventory}\nenv: {{HF_TOKEN: hunter2}}\n")
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        assert name in out
    assert "NODE_RANK=2" in out and "hunter2" not in out
    assert "nfs-1" not in out
    # nothing was created
    assert not (tmp_path / ".ftbundle").exists()


def test_cli_bad_input_exits_2_and_starts_nothing(tmp_path, capsys):
    from ftbundle.cli import main
    path = job_file(tmp_path, "name: j\nshared_dir: .s\ntrain: {command: 'touch started'}\nmaster_port: 0\n")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "master_port" in err and str(path) in err
    assert not (tmp_path / ".s").exists() and not (tmp_path / "started").exists()


def test_secret_values_never_reach_the_terminal(tmp_path, capfd):
    """A job that prints its token: ftbundle's terminal output and the node log show
    <redacted> instead."""
    from ftbundle.cli import main
    path = job_file(tmp_path, f"name: leak\nshared_dir: .s\nmaster_port: {free_port()}\n"
                              "env: {HF_TOKEN: hf_abcdef123456}\n"
                              "train: {command: 'echo token is $HF_TOKEN; exit 5'}\n")
    assert main(["run", "-v", str(path)]) == 5  # -v: rank 0's raw output on the terminal
    captured = capfd.readouterr()
    assert "hf_abcdef123456" not in captured.out + captured.err
    assert "token is <redacted>" in captured.out
    assert main(["run", str(path)]) == 5  # the progress display's failure summary (the log's end)
    captured = capfd.readouterr()
    assert "hf_abcdef123456" not in captured.out + captured.err
    assert "| token is <redacted>" in captured.err
    run_dir = sorted((tmp_path / ".s/runs").iterdir())[0]
    assert "hf_abcdef123456" not in (run_dir / "plan.json").read_text()
    # the node log ftbundle writes on shared storage holds the job's output, redacted
    log = (run_dir / "node-0-localhost.a1.log").read_text()
    assert log == "token is <redacted>\n"
    assert (run_dir / "node-0.a1.exit").read_text().strip() == "5"  # the job's code, not the filter's


def test_a_urls_password_is_a_secret_whatever_its_variables_name(tmp_path, capfd):
    """MLFLOW_TRACKING_URI=http://user:password@host (MLflow takes its credentials so), a proxy's
    URL: not secret by name, yet the password in them is masked wherever a secret's value is (the
    terminal, the node log, plan.json, --dry-run); the user, host and the job's own value stay."""
    from ftbundle.cli import main

    path = job_file(tmp_path, f"name: urls\nshared_dir: .s\nmaster_port: {free_port()}\n"
                              "env: {MLFLOW_TRACKING_URI: 'http://ann:s3cret-pw@ml:5000', "
                              "HTTPS_PROXY: 'http://proxy-user:pr0xy-pw-9@proxy:3128', PLAIN_URL: 'http://ml:5000', "
                              "SHORT: 'http://u:pw@h'}\n"
                              "train: {command: 'echo uri is $MLFLOW_TRACKING_URI via $HTTPS_PROXY; exit 5'}\n")
    assert main(["run", "-v", str(path)]) == 5
    captured = capfd.readouterr()
    assert "s3cret-pw" not in captured.out + captured.err and "pr0xy-pw-9" not in captured.out + captured.err
    assert "uri is http://ann:<redacted>@ml:5000 via http://proxy-user:<redacted>@proxy:3128" in captured.out
    run_dir = sorted((tmp_path / ".s/runs").iterdir())[0]
    assert (run_dir / "node-0-localhost.a1.log").read_text() == (
        "uri is http://ann:<redacted>@ml:5000 via http://proxy-user:<redacted>@proxy:3128\n")
    env = json.loads((run_dir / "plan.json").read_text())["nodes"][0]["env"]
    assert env["MLFLOW_TRACKING_URI"] == "http://ann:<redacted>@ml:5000" and env["PLAIN_URL"] == "http://ml:5000"
    assert env["SHORT"] == "http://u:pw@h"  # (too short to mask safely, as any secret)
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capfd.readouterr().out
    assert "s3cret-pw" not in out and "MLFLOW_TRACKING_URI=http://ann:<redacted>@ml:5000" in out, out


def test_the_hosts_env_files_secrets_are_masked_in_the_log_as_the_jobs_are(tmp_path, capfd):
    """The host's env file (sourced by the node program; the launcher never reads it) may hold a
    tracking server's URL with its password, or a token: a rank printing them (MLflow's traceback
    names the URL it called) has them masked in the node log and on the terminal as the job's own
    secrets are; the rest of the file's values, and the job's own, are untouched."""
    from ftbundle.cli import main

    env_file = tmp_path / "nccl.env"
    env_file.write_text("NCCL_DEBUG=WARN\n"
                        "export MLFLOW_TRACKING_URI=http://ann:f1le-pw-77@ml:5000/x\n"
                        "HUB_TOKEN='hf-from-file-123'\n"
                        "PROXIES=\"http://a:two-pw-one@p1:1 https://b:two-pw-two@p2:2\"\n"
                        "  LAST_URL=ftp://c:no-newline-pw@h")  # (no newline at its end)
    path = job_file(tmp_path, f"name: envfile\nshared_dir: .s\nmaster_port: {free_port()}\nruntime: {{env_file: {env_file}}}\n"
                              "env: {JOB_TOKEN: job-tok-456}\n"
                              "train: {command: 'echo $NCCL_DEBUG $MLFLOW_TRACKING_URI $HUB_TOKEN; echo $PROXIES; "
                              "echo $LAST_URL $JOB_TOKEN; exit 5'}\n")
    assert main(["run", "-v", str(path)]) == 5
    captured = capfd.readouterr()
    expected = ("WARN http://ann:<redacted>@ml:5000/x <redacted>\n"
                "http://a:<redacted>@p1:1 https://b:<redacted>@p2:2\n"
                "ftp://c:<redacted>@h <redacted>\n")
    for secret in ("f1le-pw-77", "hf-from-file-123", "two-pw-one", "two-pw-two", "no-newline-pw", "job-tok-456"):
        assert secret not in captured.out + captured.err, secret
    run_dir = sorted((tmp_path / ".s/runs").iterdir())[0]
    assert (run_dir / "node-0-localhost.a1.log").read_text() == expected
    for line in expected.splitlines():
        assert line in captured.out, captured.out


def test_reprs_and_the_plan_file_hide_secret_values_wherever_they_appear(tmp_path, inventory, capsys):
    """repr() of a node, a host and a job shows no env or vars; a train.args or train.command
    value equal to a secret is masked in plan.json and --dry-run (not only the env entry)."""
    from ftbundle.cli import main

    inventory.write_text(INVENTORY.replace("ftb_shared_dir: /shared", "ftb_shared_dir: /shared\n        db_password: vault-me-9"))
    body = ("name: j\nhosts: trainers\nnproc_per_node: 1\nenv: {HF_TOKEN: hf_abcdef123456, X_TOKEN: only-env-777}\n"
            "train: {script: train.py, args: [--token, hf_abcdef123456, --hub=hf_abcdef123456]}\n")
    plan = plan_for(tmp_path, inventory, body)
    node = plan.nodes[0]
    for obj in (node, node.host, load_job(job_file(tmp_path, body))):
        assert "only-env-777" not in repr(obj) and "vault-me-9" not in repr(obj)
    assert "hf_abcdef123456" in node.argv  # the job still gets its arguments
    text = json.dumps(plan.to_dict())
    assert "hf_abcdef123456" not in text and "--hub=<redacted>" in text
    assert main(["run", str(job_file(tmp_path, body)), "-i", str(inventory), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "hf_abcdef123456" not in out and "--token <redacted> --hub=<redacted>" in out, out
    command = plan_for(tmp_path, inventory, "name: j\nhosts: trainers\nenv: {API_KEY: sk-live-000111}\n"
                                            "train: {command: 'curl -H sk-live-000111 x'}\n")
    assert "sk-live-000111" not in json.dumps(command.to_dict())


def test_llamafactory_credentials_travel_in_the_environment_not_the_staged_config(tmp_path, inventory):
    body = ("name: j\nhosts: trainers\ntrain:\n  llamafactory: {model_name_or_path: m, dataset: x, output_dir: /shared/o, "
            "hf_hub_token: hf_zzz111222, swanlab_api_key: sw-key-333, tokenized_path: /shared/tok, "
            "max_new_tokens: 5}\n")
    plan = plan_for(tmp_path, inventory, body)
    staged = yaml.safe_load(plan.files["llamafactory.yaml"])
    assert "hf_hub_token" not in staged and "swanlab_api_key" not in staged
    assert staged["tokenized_path"] == "/shared/tok" and staged["max_new_tokens"] == 5  # not credentials
    env = plan.nodes[1].env
    assert env["FTB_LF_HF_HUB_TOKEN"] == "hf_zzz111222" and env["FTB_LF_SWANLAB_API_KEY"] == "sw-key-333"
    assert env["FTB_LF_FROM_ENV"] == "hf_hub_token swanlab_api_key"
    text = json.dumps(plan.to_dict())
    assert "hf_zzz111222" not in text and "sw-key-333" not in text
