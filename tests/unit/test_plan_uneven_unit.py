"""Uneven fleets (issue 36): hosts with different rank counts in one job. The pure core:
a real Ansible inventory with ``ftb_nproc_per_node`` / ``ftb_gpus`` host vars -> the plan
(ranks, WORLD_SIZE, each node's torchrun and env), ``auto`` from hosts that see different
GPU counts, the check's GPU rule, and --dry-run. No hosts are reached."""

import json
from pathlib import Path

import pytest
import yaml

from ftbundle.check import rules as R
from ftbundle.errors import UserError
from ftbundle.facts import ClusterFacts, HostFacts, add_gpu_ids, parse_nvidia_smi
from ftbundle.inventory import Host, load_hosts
from ftbundle.job import load_job
from ftbundle.layout import make_layout
from ftbundle.plan import make_plan, shape_text
from ftbundle.runlogs import parse_rank

SMI = Path(__file__).parents[1] / "data" / "nvidia-smi"
IMAGE = "reg/train@sha256:" + "a" * 64


def smi(name: str):
    """Recorded nvidia-smi output of a real host."""
    gpus = parse_nvidia_smi((SMI / name).read_text())
    ids = SMI / name.replace(".csv", ".ids.csv")
    return add_gpu_ids(gpus, ids.read_text()) if ids.exists() else gpus


def facts(host: str, rank: int = 0, **kw) -> HostFacts:
    return HostFacts(host, rank, **kw)


def inventory(tmp_path: Path, a: dict | None = None, b: dict | None = None) -> Path:
    """Two hosts, big (rank 0) and small, with the host vars given."""
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {
        "big": {"ansible_host": "10.9.0.11", **(a or {})},
        "small": {"ansible_host": "10.9.0.12", **(b or {})},
    }, "vars": {"ftb_shared_dir": "/shared"}}}))
    return path


def layout(tmp_path: Path, a: dict | None = None, b: dict | None = None, **job):
    body = {"name": "j", "inventory": str(inventory(tmp_path, a, b)), "train": {"script": "train.py"}, **job}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(body))
    loaded = load_job(tmp_path / "job.yaml")
    return make_layout(loaded, load_hosts(loaded.inventory), "r1")


def arg(argv, flag: str) -> str:
    return argv[list(argv).index(flag) + 1]


# ---------------------------------------------------------------------------------------
# per-host counts from the inventory


def test_host_var_gives_one_host_its_own_count(tmp_path):
    plan = make_plan(layout(tmp_path, b={"ftb_nproc_per_node": 1}, nproc_per_node=2))
    assert plan.nprocs == (2, 1) and plan.world_size == 3 and plan.nnodes == 2
    big, small = plan.nodes
    assert (big.nproc, big.first_rank, small.nproc, small.first_rank) == (2, 0, 1, 2)
    # each node's torchrun gets its own count; ranks stay contiguous per node in node order
    assert arg(big.torchrun, "--nproc_per_node") == "2" and arg(small.torchrun, "--nproc_per_node") == "1"
    assert arg(big.torchrun, "--nnodes") == arg(small.torchrun, "--nnodes") == "2"
    assert [arg(n.torchrun, "--node_rank") for n in plan.nodes] == ["0", "1"]
    assert arg(big.torchrun, "--redirects") == "1:3" and "--redirects" not in small.torchrun
    assert [n.env["NPROC_PER_NODE"] for n in plan.nodes] == ["2", "1"]
    assert [n.env["NNODES"] for n in plan.nodes] == ["2", "2"]
    assert plan.shape == "2 node(s) with 2+1 rank(s)"
    data = plan.to_dict()
    assert data["world_size"] == 3 and data["nprocs"] == [2, 1] and data["nproc_per_node"] == 2
    assert [(n["nproc"], n["ranks"]) for n in data["nodes"]] == [(2, [0, 1]), (1, [2, 2])]
    json.dumps(data)


def test_host_var_over_the_jobs_value_and_over_auto(tmp_path):
    """The host var wins over a number and over auto; with every host's count known,
    `auto` needs no GPU counts from the hosts (--no-check and --dry-run plan it)."""
    both = layout(tmp_path, a={"ftb_nproc_per_node": 8}, b={"ftb_nproc_per_node": "4"}, nproc_per_node="auto")
    assert not both.needs_gpu_counts
    assert make_plan(both).nprocs == (8, 4)
    assert make_plan(layout(tmp_path, a={"ftb_nproc_per_node": 3}, nproc_per_node=1)).nprocs == (3, 1)
    one = layout(tmp_path, b={"ftb_nproc_per_node": 2}, nproc_per_node="auto")
    assert one.needs_gpu_counts
    with pytest.raises(UserError, match="ftb_nproc_per_node in the inventory for big"):
        make_plan(one)
    plan = make_plan(one, ClusterFacts([facts("big", gpus=smi("h100-x8.csv")), facts("small", 1)]))
    assert plan.nprocs == (8, 2)  # small has no GPU: its 2 ranks are CPU ranks, as its host var says


@pytest.mark.parametrize("value", ["two", 0, -1, 1.5, True, "", "1025", [2]])
def test_bad_host_nproc_exits_2_naming_host_var_and_valid_values(tmp_path, value):
    with pytest.raises(UserError) as err:
        layout(tmp_path, b={"ftb_nproc_per_node": value}, nproc_per_node=2)
    text = str(err.value)
    assert "ftb_nproc_per_node of small" in text and "from 1 to 1024" in text and "hosts.yml" in text


@pytest.mark.parametrize("value", ["", "a,b", "0,0", "0,,1", True, "0;1", [], "-1"])
def test_bad_ftb_gpus_exits_2_naming_host_var_and_valid_values(tmp_path, value):
    with pytest.raises(UserError) as err:
        layout(tmp_path, a={"ftb_gpus": value})
    assert "ftb_gpus of big" in str(err.value) and '"0,1,2,3"' in str(err.value)


def test_host_var_on_the_cli_exits_2(tmp_path, capsys):
    from ftbundle.cli import main

    inventory(tmp_path, b={"ftb_nproc_per_node": "zero"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"name": "j", "inventory": str(tmp_path / "hosts.yml"),
                                                        "train": {"script": "t.py"}}))
    assert main(["run", str(tmp_path / "job.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "ftb_nproc_per_node of small must be a whole number of ranks from 1 to 1024, got 'zero'" in err


# ---------------------------------------------------------------------------------------
# ftb_gpus: which GPUs of a host the job uses


def test_ftb_gpus_is_the_hosts_cuda_visible_devices(tmp_path):
    plan = make_plan(layout(tmp_path, a={"ftb_gpus": "0,1,2,3"}, b={"ftb_gpus": [4, 5]}, nproc_per_node="auto"))
    assert plan.nprocs == (4, 2)  # auto: the GPUs its ranks will see, known without asking the host
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in plan.nodes] == ["0,1,2,3", "4,5"]
    # a whole gpus_per_node narrows a host's ftb_gpus to its first N; 0 is a CPU job
    two = make_plan(layout(tmp_path, a={"ftb_gpus": "4,5,6,7"}, nproc_per_node=2, gpus_per_node=2))
    assert two.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "4,5" and "CUDA_VISIBLE_DEVICES" not in two.nodes[1].env
    # (issue 45: ftb_gpus in a CPU job was dropped in silence, CUDA_VISIBLE_DEVICES ""; now refused, named)
    with pytest.raises(UserError, match="ftb_gpus is set for big in the inventory, and the job is a CPU job"):
        layout(tmp_path, a={"ftb_gpus": "4,5"}, nproc_per_node=2, gpus_per_node=0)
    cpu = make_plan(layout(tmp_path, nproc_per_node=2, gpus_per_node=0))
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in cpu.nodes] == ["", ""]
    uuid = make_plan(layout(tmp_path, a={"ftb_gpus": "GPU-5d6c1e7a-0b8e-4c1c-9f4e-1a2b3c4d5e6f"}, nproc_per_node=1))
    assert uuid.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "GPU-5d6c1e7a-0b8e-4c1c-9f4e-1a2b3c4d5e6f"


def test_ftb_gpus_and_the_jobs_cuda_visible_devices_are_one_choice_too_many(tmp_path):
    with pytest.raises(UserError, match="ftb_gpus in the inventory for small: choose the GPUs in one place"):
        layout(tmp_path, b={"ftb_gpus": "0"}, env={"CUDA_VISIBLE_DEVICES": "1"})


def test_ftb_gpus_with_the_docker_runtime_are_its_devices(tmp_path):
    runtime = {"kind": "docker", "image": IMAGE}
    plan = make_plan(layout(tmp_path, a={"ftb_gpus": "0,1"}, b={"ftb_gpus": "3"}, nproc_per_node="auto",
                            runtime=runtime))
    big, small = plan.nodes
    assert plan.nprocs == (2, 1)
    assert arg(big.argv, "--gpus") == '"device=0,1"' and arg(small.argv, "--gpus") == '"device=3"'
    # renumbered 0..n-1 inside the container: the host's numbers are not passed in
    assert "CUDA_VISIBLE_DEVICES" not in big.env and "CUDA_VISIBLE_DEVICES" not in big.argv
    # over the job's runtime.gpus on its host; the other host keeps the job's
    mixed = make_plan(layout(tmp_path, b={"ftb_gpus": "2,3"}, nproc_per_node=2,
                             runtime={**runtime, "gpus": "all"}))
    assert [arg(n.argv, "--gpus") for n in mixed.nodes] == ["all", '"device=2,3"']


def test_docker_gpus_per_host_from_the_facts(tmp_path):
    """Hosts that differ get each its own devices (before: `all` for every host)."""
    runtime = {"kind": "docker", "image": IMAGE}
    h100 = smi("h100-x8.csv")
    plan = make_plan(layout(tmp_path, b={"ftb_nproc_per_node": 4}, nproc_per_node=8, runtime=runtime),
                     ClusterFacts([facts("big", gpus=h100), facts("small", 1, gpus=h100)]))
    assert [arg(n.argv, "--gpus") for n in plan.nodes] == ["all", '"device=0,1,2,3"']
    assert plan.nprocs == (8, 4)


# ---------------------------------------------------------------------------------------
# auto: each host the GPUs its ranks will see


def test_auto_gives_each_host_its_own_gpu_count(tmp_path):
    h100, a100 = smi("h100-x8.csv"), smi("a100-x4.csv")
    auto = layout(tmp_path, nproc_per_node="auto")
    plan = make_plan(auto, ClusterFacts([facts("big", gpus=h100), facts("small", 1, gpus=a100)]))
    assert plan.nprocs == (8, 4) and plan.world_size == 12
    assert [n.first_rank for n in plan.nodes] == [0, 8]
    assert [arg(n.torchrun, "--nproc_per_node") for n in plan.nodes] == ["8", "4"]
    # the host's own CUDA_VISIBLE_DEVICES counts, ftb_gpus over it
    limited = ClusterFacts([facts("big", gpus=h100, env={"CUDA_VISIBLE_DEVICES": "0,1,2"}),
                            facts("small", 1, gpus=h100)])
    assert make_plan(auto, limited).nprocs == (3, 8)
    chosen = layout(tmp_path, a={"ftb_gpus": "6,7"}, nproc_per_node="auto")
    assert make_plan(chosen, limited).nprocs == (2, 8)
    # a host that sees no GPU: named, and how to give it ranks
    with pytest.raises(UserError, match="0 GPU\\(s\\) on small; set ftb_nproc_per_node for them"):
        make_plan(auto, ClusterFacts([facts("big", gpus=h100), facts("small", 1)]))


def test_effective_batch_line_counts_every_rank(tmp_path):
    lf = {"llamafactory": {"model_name_or_path": "/m", "dataset": "d", "template": "default",
                           "output_dir": "/shared/out", "per_device_train_batch_size": 2,
                           "gradient_accumulation_steps": 3}}
    plan = make_plan(layout(tmp_path, b={"ftb_nproc_per_node": 1}, nproc_per_node=2, train=lf))
    assert plan.effective_batch == 18  # 2 x 3 x (2 + 1)
    assert ("effective batch size 18 = 2 per device x 3 accumulation x 3 rank(s) (2+1 on 2 nodes)"
            in plan.notes)
    even = make_plan(layout(tmp_path, nproc_per_node=2, train=lf))
    assert "effective batch size 24 = 2 per device x 3 accumulation x 2 rank(s) per node x 2 node(s)" in even.notes


def test_command_mode_gets_each_hosts_own_nproc(tmp_path):
    plan = make_plan(layout(tmp_path, a={"ftb_nproc_per_node": 8}, nproc_per_node=4,
                            train={"command": "bash finetune.sh"}))
    assert [n.env["NPROC_PER_NODE"] for n in plan.nodes] == ["8", "4"]
    assert all(n.argv == ("bash", "-c", "bash finetune.sh") for n in plan.nodes)
    assert plan.world_size == 12


def test_dry_run_shows_each_hosts_ranks_and_the_world_size(tmp_path, capsys):
    from ftbundle.cli import main

    layout(tmp_path, b={"ftb_nproc_per_node": 1}, nproc_per_node=2)
    assert main(["run", str(tmp_path / "job.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world size 3 = 2 node(s) with 2+1 rank(s)" in out
    assert "node rank 0  big  (ssh 10.9.0.11:22)  2 rank(s): global 0-1" in out
    assert "node rank 1  small  (ssh 10.9.0.12:22)  1 rank(s): global 2" in out
    assert "NPROC_PER_NODE=1" in out and "--nproc_per_node 1" in out


def test_uniform_plans_read_as_before(tmp_path):
    plan = make_plan(layout(tmp_path, nproc_per_node=4))
    assert plan.nprocs == (4, 4) and plan.nproc_per_node == 4 and plan.world_size == 8
    assert plan.shape == "2 node(s) x 4 rank(s)" and plan.uniform
    assert shape_text([8, 4], "host(s)") == "2 host(s) with 8+4 rank(s)"


def test_a_global_rank_is_found_on_its_node():
    assert [parse_rank(str(r), 2, [2, 1]) for r in range(3)] == [(0, 0), (0, 1), (1, 0)]
    assert parse_rank("1:0", 2, [2, 1]) == (1, 0)
    for bad in ("3", "1:1", "-1"):
        with pytest.raises(UserError, match="global rank 0-2 .* LOCAL below the node's ranks \\(2\\+1\\)"):
            parse_rank(bad, 2, [2, 1])


# ---------------------------------------------------------------------------------------
# the check's report


def test_check_accepts_hosts_with_different_gpu_counts_and_says_each_ones_ranks(tmp_path):
    h100 = smi("h100-x8.csv")
    four = h100[:4]
    auto = layout(tmp_path, nproc_per_node="auto")
    check = R.check_gpus([facts("big", gpus=h100), facts("small", 1, gpus=four)], auto, None)
    assert check.ok, check
    assert "ranks per host differ: 8 rank(s) on big; 4 rank(s) on small; world size 12" in check.notes
    assert not any("export" in n for n in check.notes)  # the run uses what an export requests: nothing said
    # different kinds of GPU still differ
    v100 = smi("v100-x8.csv")
    assert R.check_gpus([facts("big", gpus=h100), facts("small", 1, gpus=v100)], auto, None).failure == "GPUs differ"


def test_check_names_the_host_var_a_host_cannot_fit(tmp_path):
    h100 = smi("h100-x8.csv")
    over = layout(tmp_path, b={"ftb_nproc_per_node": 6}, nproc_per_node=8)
    check = R.check_gpus([facts("big", gpus=h100), facts("small", 1, gpus=h100[:4])], over, 8)
    assert check.failure == "GPUs do not fit nproc_per_node"
    assert check.details == ["ftb_nproc_per_node of small is 6 but small has 4 GPU(s)"]
    fixed = R.check_gpus([facts("big", gpus=h100), facts("small", 1, gpus=h100[:4])],
                         layout(tmp_path, nproc_per_node=8), 8)
    assert fixed.details == ["nproc_per_node is 8 but small has 4 GPU(s)"]
    assert "small can run 4 rank(s): set ftb_nproc_per_node: 4 for it in the inventory, or nproc_per_node: auto" \
        in fixed.notes
    chosen = layout(tmp_path, b={"ftb_gpus": "0,1"}, nproc_per_node=4)
    check = R.check_gpus([facts("big", gpus=h100), facts("small", 1, gpus=h100)], chosen, 4)
    assert check.details == ["nproc_per_node is 4 but small has 2 GPU(s) visible (ftb_gpus)"]
    missing = layout(tmp_path, b={"ftb_gpus": "0,9"}, nproc_per_node="auto")
    check = R.check_gpus([facts("big", gpus=h100), facts("small", 1, gpus=h100)], missing, None)
    assert "nproc_per_node is 2 but small has 1 GPU(s) visible (ftb_gpus)" in check.details
    none = R.check_gpus([facts("big", gpus=h100), facts("small", 1)], layout(tmp_path, nproc_per_node="auto"), None)
    assert "nproc_per_node is auto but small has no GPU visible to the job; set ftb_nproc_per_node for it " \
           "in the inventory" in none.details


def test_local_hosts_may_differ_too():
    """Two local hosts (a laptop test) are allowed: uneven counts are the plan's, not SSH's."""
    from ftbundle.job import parse_job
    from tests.support.helpers import plan_of

    job = parse_job({"name": "j", "nproc_per_node": 2, "train": {"script": "t.py"}}, Path("/tmp/job.yaml"))
    hosts = [Host("a", "127.0.0.1", local=True, vars={}), Host("b", "127.0.0.1", local=True,
                                                                vars={"ftb_nproc_per_node": 1})]
    assert plan_of(job, hosts).nprocs == (2, 1)
