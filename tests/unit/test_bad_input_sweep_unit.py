"""The sweep of bad inputs a newcomer's day zero found (issue 35, item 7), on this machine:
each exits 2 with one message that names the file (with its line where there is one) or the
key and what is valid, no traceback, no message longer than a screen, within seconds (no
read without a size cap, no open that blocks on a special file), and nothing written.

The inputs that only hosts can judge (a script missing there, an interpreter without torch,
more CPU ranks than cores) are in tests/cluster/test_bad_input.py, on containerized hosts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SCREEN = 2200  # characters: "ftbundle: error: " and a message cut at 2000


def ftb(cwd: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftbundle", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def job(tmp: Path, name: str = "job.yaml", **over) -> Path:
    body = {"name": "sweep", "nproc_per_node": 1, "shared_dir": str(tmp / "shared"), "train": {"command": "true"}}
    body.update(over)
    path = tmp / name
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def lf(tmp: Path, **config) -> dict:
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "org/model", "stage": "sft", **config}))
    return {"llamafactory": "train.yaml"}


# Each case: (its files made in tmp) -> (argv after `ftbundle`, fragments the message must hold)
def case_job_not_utf8(tmp):
    (tmp / "job.yaml").write_bytes(b"name: sweep\nenv:\n  A: caf\xe9\ntrain: {command: 'true'}\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml:3", "not UTF-8", "byte 0xe9 at line 3"]


def case_llamafactory_config_not_utf8(tmp):
    job(tmp, train={"llamafactory": "train.yaml"})
    (tmp / "train.yaml").write_bytes(b"model_name_or_path: m\x00\xff\n")
    return ["run", "job.yaml", "--dry-run"], ["key 'train.llamafactory'", "LlamaFactory config is not UTF-8"]


def case_deepspeed_json_not_utf8(tmp):
    job(tmp, train={"llamafactory": "train.yaml", "deepspeed": "ds.json"})
    lf(tmp)
    (tmp / "ds.json").write_bytes(b'{"zero_optimization": {"stage": 2}, "x": "\xff"}')
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/ds.json", "DeepSpeed config is not UTF-8"]


def case_llamafactory_config_is_a_directory(tmp):
    job(tmp, train={"llamafactory": "configs"})
    (tmp / "configs").mkdir()
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml:", "key 'train.llamafactory'",
                                              f"LlamaFactory config {tmp}/configs is a directory, not a file"]


def case_job_is_a_symlink_loop(tmp):
    os.symlink("b.yaml", tmp / "a.yaml")
    os.symlink("a.yaml", tmp / "b.yaml")
    return ["run", "a.yaml", "--dry-run"], ["a.yaml", "symbolic link loop"]


def case_job_is_dev_zero(tmp):
    return ["run", "/dev/zero", "--dry-run"], ["/dev/zero", "is a character device, not a file"]


def case_job_is_a_fifo(tmp):
    os.mkfifo(tmp / "job.yaml")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "is a FIFO (named pipe), not a file"]


def case_llamafactory_config_is_a_fifo(tmp):
    job(tmp, train={"llamafactory": "train.yaml"})
    os.mkfifo(tmp / "train.yaml")
    return ["run", "job.yaml", "--dry-run"], ["key 'train.llamafactory'", "is a FIFO (named pipe), not a file"]


def case_job_of_550000_env_entries(tmp):
    lines = ["name: sweep", "train: {command: 'true'}", "env:"] + [f"  V{i}: x" for i in range(550_000)]
    (tmp / "job.yaml").write_text("\n".join(lines) + "\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "bytes; at most 1,048,576 are read"]


def case_alias_expanded_name(tmp):
    """A billion-laughs value where a name belongs: the message shows it cut, not 39 MB of it."""
    lines = ["train:", "  llamafactory:", "    a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"    {chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 9)}]" for i in range(1, 9)]
    (tmp / "job.yaml").write_text("\n".join(lines + ["name: *i"]) + "\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml:12", "key 'name'", "must be a non-empty string",
                                              "...]"]


def case_duplicated_key_in_job(tmp):
    (tmp / "job.yaml").write_text("name: sweep\nnproc_per_node: 1\nnproc_per_node: 4\ntrain: {command: 'true'}\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml:3:1", "key 'nproc_per_node' appears twice",
                                              "first on line 2"]


def case_duplicated_key_in_llamafactory_config(tmp):
    job(tmp, train={"llamafactory": "train.yaml"})
    (tmp / "train.yaml").write_text("model_name_or_path: a\nlearning_rate: 1e-4\nlearning_rate: 1e-3\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/train.yaml:3:1", "key 'learning_rate' appears twice"]


def case_llamafactory_config_without_a_model(tmp):
    job(tmp, train={"llamafactory": "train.yaml"})
    (tmp / "train.yaml").write_text("stage: sft\ndo_train: true\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/train.yaml", "key 'model_name_or_path'", "is required"]


def case_bf16_in_a_cpu_job(tmp):
    job(tmp, gpus_per_node=0, train=lf(tmp, bf16=True))
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/train.yaml", "key 'bf16'", "CPU job",
                                              "set bf16: false", "use_cpu: true"]


def case_shared_dir_is_the_root(tmp):
    job(tmp, shared_dir="/")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'shared_dir'", "is /, a system directory"]


def case_binary_inventory(tmp):
    job(tmp)
    (tmp / "hosts.ini").write_bytes(bytes(range(256)) * 8)
    return ["run", "job.yaml", "-i", "hosts.ini", "--dry-run"], ["hosts.ini", "inventory is not UTF-8"]


def case_garbage_ini_inventory(tmp):
    job(tmp)
    (tmp / "hosts.ini").write_text("[trainers\nnode0 ansible_host=\n")
    return ["run", "job.yaml", "-i", "hosts.ini", "--dry-run"], [
        "hosts.ini", "Ansible cannot parse this inventory (ini plugin:", "an inventory is a YAML mapping"]


def case_yaml_list_inventory(tmp):
    job(tmp)
    (tmp / "hosts.yml").write_text("- node0\n- node1\n")
    return ["run", "job.yaml", "-i", "hosts.yml", "--dry-run"], [
        "hosts.yml", "(yaml plugin: YAML inventory has invalid structure, it should be a dictionary, got: list)"]


def case_inventory_without_hosts(tmp):
    job(tmp)
    (tmp / "hosts.yml").write_text("all:\n  children:\n    trainers:\n")
    return ["run", "job.yaml", "-i", "hosts.yml", "--dry-run"], ["hosts.yml", "inventory has no hosts: list them"]


def case_logs_negative_lines(tmp):
    job(tmp)
    return ["logs", "job.yaml", "-n", "-5"], ["argument -n/--lines: must be a number of lines, 0 or more; got '-5'"]


def case_init_negative_gpus(tmp):
    return ["init", "--dir", "proj", "--gpus", "-1", "--yes"], ["key '--gpus'", "must be 0 (a CPU job"]


# LlamaFactory values (issue 45, item 1): judged by LlamaFactory's own declarations (ftbundle/lfargs)
def _lf_case(tmp, line_of_key: int, key: str, fragments: list[str], **config):
    job(tmp, train=lf(tmp, **config))
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/train.yaml:{line_of_key}", f"key '{key}'", *fragments]


def _line(tmp, key: str) -> int:
    return next(n for n, line in enumerate((tmp / "train.yaml").read_text().splitlines(), 1) if line.startswith(key + ":"))


def _lf(tmp, key: str, fragments: list[str], **config):
    argv, _ = _lf_case(tmp, 0, key, fragments, **config)
    return argv, [f"{tmp}/train.yaml:{_line(tmp, key)}", f"key '{key}'", *fragments]


def case_lf_zero_accumulation_steps(tmp):
    return _lf(tmp, "gradient_accumulation_steps", ["must be at least 1; got 0"], gradient_accumulation_steps=0)


def case_lf_fractional_accumulation_steps(tmp):
    return _lf(tmp, "gradient_accumulation_steps", ["must be a whole number", "got 2.5"], gradient_accumulation_steps=2.5)


def case_lf_negative_batch(tmp):
    return _lf(tmp, "per_device_train_batch_size", ["must be at least 1; got -1"], per_device_train_batch_size=-1)


def case_lf_batch_in_words(tmp):
    return _lf(tmp, "per_device_train_batch_size", ["must be a whole number", "got 'four'"],
               per_device_train_batch_size="four")


def case_lf_null_batch(tmp):
    return _lf(tmp, "per_device_train_batch_size", ["must be a whole number", "got null"],
               per_device_train_batch_size=None)


def case_lf_learning_rate_in_words(tmp):
    return _lf(tmp, "learning_rate", ["must be a number", "got 'fast'"], learning_rate="fast")


def case_lf_misspelt_finetuning_type(tmp):
    return _lf(tmp, "finetuning_type", ["'lorra' is not one of LlamaFactory", "lora, oft, freeze, full",
                                        "did you mean 'lora'?"], finetuning_type="lorra")


def case_lf_unknown_key(tmp):
    return _lf(tmp, "learning_rat", ["is not an argument of LlamaFactory", "did you mean 'learning_rate'?"],
               learning_rat=1.0e-4)


def case_lf_zero_cutoff(tmp):
    return _lf(tmp, "cutoff_len", ["must be at least 1; got 0"], cutoff_len=0)


def case_lf_zero_steps(tmp):
    return _lf(tmp, "max_steps", ["trains zero steps", "set max_steps above 0 or num_train_epochs above 0"],
               max_steps=-5, num_train_epochs=0)


def case_lf_unknown_template(tmp):
    return _lf(tmp, "template", ["'qwen25' is not a chat template of LlamaFactory", "did you mean 'qwen"],
               template="qwen25")


def case_lf_inline_config_names_the_job_key(tmp):
    job(tmp, train={"llamafactory": {"model_name_or_path": "org/m", "stage": "sfft"}})
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'train.llamafactory.stage'",
                                              "'sfft' is not one of", "did you mean 'sft'?"]


def case_lf_deepspeed_json_is_a_list(tmp):
    job(tmp, train=lf(tmp, deepspeed="ds.json"))
    (tmp / "ds.json").write_text('[{"zero_optimization": {"stage": 2}}]')
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/ds.json", "key 'deepspeed'", "must be a JSON object; this one is a list"]


# The job's contradictions (issue 45, item 2)
SPARES_INVENTORY = """all:
  children:
    trainers:
      hosts:
        node0: {ansible_host: 10.0.0.1}
        node1: {ansible_host: 10.0.0.2}
    spares:
      hosts:
        node1: {}
    standby:
      hosts:
        node2: {ansible_host: 10.0.0.3}
"""


def _spare_job(tmp, **over):
    (tmp / "hosts.yml").write_text(SPARES_INVENTORY)
    return job(tmp, hosts="trainers", inventory="hosts.yml", restarts=1, on_node_loss="spare", **over)


def case_spares_group_missing(tmp):
    _spare_job(tmp, spares="sparez")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'spares'", "'sparez' names no usable group",
                                              "groups in this inventory: spares, standby, trainers"]


def case_spares_are_the_trainers(tmp):
    _spare_job(tmp)
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'spares'", "group 'spares' holds node1",
                                              "a spare must be a host that stands by"]


def case_spare_without_an_inventory(tmp):
    job(tmp, restarts=1, on_node_loss="spare")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'on_node_loss'", "has no inventory"]


def case_min_nodes_above_the_hosts(tmp):
    (tmp / "hosts.yml").write_text(SPARES_INVENTORY)
    job(tmp, hosts="trainers", inventory="hosts.yml", restarts=1, on_node_loss="exclude", min_nodes=5)
    return ["check", "job.yaml"], [f"{tmp}/job.yaml", "key 'min_nodes'", "is 5, above the 2 host(s)",
                                   "Set min_nodes to 2 or less"]


def case_keep_global_batch_on_a_command_job(tmp):
    job(tmp, restarts=1, on_node_loss="exclude", keep_global_batch=False)
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'keep_global_batch'",
                                              "only applies to a LlamaFactory job"]


def case_env_value_over_the_kernels_limit(tmp):
    job(tmp, env={"BIG": "x" * 200_000})
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'env.BIG'", "200,004 bytes",
                                              "at most 131,071", "Argument list too long"]


def case_env_over_a_megabyte_in_all(tmp):
    """(A job file is read up to 1 MiB: the values are one, repeated by YAML aliases.)"""
    value = "x" * 100_000
    lines = ["name: sweep", "nproc_per_node: 1", "train: {command: 'true'}", "env:", f"  V0: &v {value}"]
    (tmp / "job.yaml").write_text("\n".join(lines + [f"  V{i}: *v" for i in range(1, 12)]) + "\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'env'", "more than 1,048,576 bytes"]


def case_env_empty_path(tmp):
    job(tmp, env={"PATH": ""})
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'env.PATH'", "no absolute directory",
                                              "exit 127"]


# ftbundle's own tracebacks, and values the inventory and the export hold (issue 45, items 2 and 3)
def case_plot_into_proc(tmp):
    job(tmp)
    return ["plot", "job.yaml", "-o", "/proc/x.png"], ["/proc/x.png", "key '-o'", "a kernel file system"]


def case_plot_into_a_missing_directory(tmp):
    job(tmp)
    return ["plot", "job.yaml", "-o", "nodir/sub/x.png"], ["nodir/sub/x.png", "key '-o'", f"{tmp}/nodir/sub does not exist"]


def _inventory_job(tmp, host_vars: str):
    (tmp / "hosts.yml").write_text(f"all:\n  children:\n    trainers:\n      hosts:\n        node0: {host_vars}\n")
    return job(tmp, hosts="trainers", inventory="hosts.yml")


def case_ansible_port_out_of_range(tmp):
    _inventory_job(tmp, "{ansible_host: 10.0.0.1, ansible_port: 70000}")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/hosts.yml", "key 'ansible_port'", "node0 is 70000",
                                              "1 to 65535"]


def case_ansible_host_empty(tmp):
    _inventory_job(tmp, "{ansible_host: ''}")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/hosts.yml", "key 'ansible_host'", "node0 is empty"]


def case_output_dir_under_proc(tmp):
    (tmp / "shared").mkdir()  # (the check creates a missing shared_dir: here, only output_dir is wrong)
    job(tmp, train=lf(tmp, output_dir="/proc/ftb/out"), runtime={"kind": "host", "python": sys.executable})
    return ["run", "job.yaml"], ["LlamaFactory's output_dir /proc/ftb/out cannot be written",
                                 "localhost: /proc is a kernel file system", "give output_dir (LlamaFactory config)"]


def case_output_dir_is_a_file(tmp):
    (tmp / "saves").write_text("")
    (tmp / "shared").mkdir()
    job(tmp, train=lf(tmp, output_dir=str(tmp / "saves" / "lora")), runtime={"kind": "host", "python": sys.executable})
    return ["run", "job.yaml"], [f"LlamaFactory's output_dir {tmp}/saves/lora cannot be written",
                                 f"localhost: {tmp}/saves: a file, not a directory"]


def case_deepspeed_json_named_in_the_config_is_nowhere(tmp):
    (tmp / "shared").mkdir()
    job(tmp, train=lf(tmp, deepspeed="ds_z3.json"), runtime={"kind": "host", "python": sys.executable})
    return ["run", "job.yaml"], [f"deepspeed {tmp}/ds_z3.json on localhost"]


def case_slow_below_without_burn_in(tmp):
    job(tmp)
    return ["check", "job.yaml", "--slow-below", "0.8"], ["key '--slow-below'", "only applies with --burn-in"]


def case_min_gbps_without_net(tmp):
    job(tmp)
    return ["check", "job.yaml", "--min-gbps", "25"], ["key '--min-gbps'", "only applies with --net"]


def case_inventory_host_twice_with_two_addresses(tmp):
    (tmp / "hosts.yml").write_text("all:\n  children:\n    trainers:\n      hosts:\n        node0: {ansible_host: 10.0.0.1}\n"
                                   "    spares:\n      hosts:\n        node0: {ansible_host: 10.0.0.2}\n")
    job(tmp, hosts="trainers", inventory="hosts.yml")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/hosts.yml", "key 'ansible_host'",
                                              "node0 is given ansible_host 10.0.0.1 and also 10.0.0.2",
                                              "give each machine its own name"]


def case_export_time_forever(tmp):
    job(tmp)
    return ["export", "job.yaml", "--to", "slurm", "--nodes", "1", "--time", "forever"], [
        "key '--time'", "'forever' is not a Slurm time limit", "D-HH:MM:SS"]


def case_export_pbs_time_in_days(tmp):
    job(tmp)
    return ["export", "job.yaml", "--to", "pbs", "--nodes", "1", "--time", "2-00:00:00"], [
        "key '--time'", "is not a PBS walltime"]


def case_ftb_gpus_in_a_cpu_job(tmp):
    _inventory_job(tmp, "{ansible_host: 10.0.0.1, ftb_gpus: '0,1'}")
    (tmp / "job.yaml").write_text((tmp / "job.yaml").read_text() + "gpus_per_node: 0\n")
    return ["run", "job.yaml", "--dry-run"], [f"{tmp}/job.yaml", "key 'gpus_per_node'", "ftb_gpus is set for node0",
                                              "a CPU job"]


CASES = {name[5:]: func for name, func in globals().items() if name.startswith("case_")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_short_message_naming_it_and_writes_nothing(tmp_path, case):
    argv, fragments = CASES[case](tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = ftb(tmp_path, *argv)
    message = proc.stderr
    assert proc.returncode == 2, f"rc={proc.returncode}\n{message[:3000]}\n{proc.stdout[:2000]}"
    assert "Traceback" not in message, message[:5000]
    assert len(message) <= SCREEN, f"{len(message)} characters:\n{message[:3000]}"
    assert message.count("error:") == 1, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_no_runs_yet_is_said_as_such_by_runs_and_plot(tmp_path):
    """It said '.../runs is not on this machine and there is no host to read it through'."""
    job(tmp_path)
    proc = ftb(tmp_path, "runs", "job.yaml")
    assert proc.returncode == 0 and proc.stdout.strip() == f"no runs of sweep in {tmp_path}/shared/runs yet", proc
    proc = ftb(tmp_path, "plot", "job.yaml")
    assert proc.returncode == 2 and f"no run of job 'sweep' in {tmp_path}/shared/runs to plot" in proc.stderr, proc
    assert "not on this machine" not in proc.stderr


def test_a_shared_dir_that_is_a_file_is_named_as_one(tmp_path):
    (tmp_path / "shared").write_text("")
    job(tmp_path)
    proc = ftb(tmp_path, "check", "job.yaml", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"shared_dir {tmp_path}/shared on localhost: it is a file, not a directory: set shared_dir (job) or "
            "ftb_shared_dir (inventory) to a directory") in proc.stdout, proc.stdout
    assert "File exists" not in proc.stdout
