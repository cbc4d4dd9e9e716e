"""Tokens per second, per GPU (per rank on CPUs) and MFU (issue 47 item 1): the GPU's peak from
nvidia-smi's real names, the trainer's token count turned on in the staged config, MFU against
a hand count, and the figures on the live line, in the summary, summary.json and `runs`."""

from __future__ import annotations

import json

import pytest

from ftbundle import speed as S
from ftbundle.check.burnin import BurninReport, Figure, compare, figures_of, gemm_note, gemm_record
from ftbundle.facts import ClusterFacts, Gpu
from ftbundle.history import format_runs, run_row, speed_record
from ftbundle.ui.progress import Progress, status_fields
from ftbundle.ui.summary import closing_summary
from ftbundle.inventory import Host
from ftbundle.layout import make_layout
from ftbundle.plan import make_plan
from tests.unit.test_check_unit import SMI, facts, job_of, smi


def test_the_peak_of_the_gpus_users_run_from_nvidia_smis_own_names():
    assert S.gpu_peak(smi("h100-health.csv")[0].name) == ("H100 SXM", 989.0)  # "NVIDIA H100 80GB HBM3"
    assert S.gpu_peak(smi("a100-x4.csv")[0].name) == ("A100", 312.0)  # "NVIDIA A100-SXM4-80GB"
    assert S.gpu_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.0)
    assert S.gpu_peak("NVIDIA H100 NVL") == ("H100 NVL", 835.0)
    assert S.gpu_peak("NVIDIA H200") == ("H200", 989.0)
    assert S.gpu_peak("NVIDIA L40S") == ("L40S", 362.0) and S.gpu_peak("NVIDIA L4") == ("L4", 121.0)
    assert S.gpu_peak("NVIDIA GeForce RTX 4090") == ("RTX 4090", 165.0)
    # the names nvidia-smi gives the other GPUs fine-tuning runs on: a wrong row here is an MFU
    # that looks right and is not (the 'with sparsity' figures are twice these)
    assert S.gpu_peak("NVIDIA H200 NVL") == ("H200 NVL", 835.0)  # (not the SXM H200's 989)
    assert S.gpu_peak("NVIDIA H800 PCIe") == ("H800 PCIe", 756.0) and S.gpu_peak("NVIDIA H800") == ("H100 SXM", 989.0)
    assert S.gpu_peak("NVIDIA H20") == ("H20", 148.0)  # (not an H200)
    assert S.gpu_peak("NVIDIA GB200") == ("GB200", 2500.0) and S.gpu_peak("NVIDIA B200") == ("B200", 2250.0)
    assert S.gpu_peak("NVIDIA L20") == ("L20", 119.5) and S.gpu_peak("NVIDIA L40") == ("L40", 181.0)
    assert S.gpu_peak("NVIDIA A40") == ("A40", 149.7) and S.gpu_peak("NVIDIA A10") == ("A10", 125.0)
    assert S.gpu_peak("NVIDIA A10G") is None  # (AWS's A10G is not the A10: unknown, the burn-in's GEMM instead)
    assert S.gpu_peak("NVIDIA RTX 6000 Ada Generation") == ("RTX 6000 Ada", 364.2)
    assert S.gpu_peak("NVIDIA RTX A6000") == ("RTX A6000", 154.8)
    assert S.gpu_peak("NVIDIA GeForce RTX 3090") == ("RTX 3090", 71.0)
    assert S.gpu_peak("Tesla V100-SXM2-32GB") is None  # (no bf16: MFU unknown, said)


def test_the_trainer_counts_tokens_without_padding_where_its_transformers_can():
    assert S.token_setting(None, "5.6.0") == ("non_padding", False)
    assert S.token_setting(None, "4.57.1") == ("non_padding", False)
    assert S.token_setting(None, "4.46.3") == (True, True)  # (every token, padding included: said)
    assert S.token_setting(None, None) == (True, True)
    assert S.token_setting("no", "5.6.0") == ("no", None)  # the job's own choice is kept
    assert S.token_setting("non_padding", None) == ("non_padding", False)


def test_mfu_against_a_hand_count():
    # Llama 3.1 8B on 8 H100 SXM at 3,100 tokens/s per GPU: 6 x 8.03e9 x 24,800 / (8 x 989e12) = 15.1%
    basis = S.SpeedBasis(ranks=8, gpus=8, gpu="H100 SXM", peak_tflops=989.0, params=8_030_261_248, padding=False)
    assert basis.mfu(24_800) == pytest.approx(6 * 8_030_261_248 * 24_800 / (8 * 989e12))
    assert f"{basis.mfu(24_800):.1%}" == "15.1%"
    assert basis.mfu_basis().startswith("6 x 8.03B parameters per token (attention's own FLOPs not counted")
    assert S.tokens_text(24_800, basis) == "24,800 tokens/s (3,100 per GPU, padding not counted)"
    cpu = S.SpeedBasis(ranks=2, padding=True)
    assert cpu.mfu(1000) is None and S.tokens_text(1000, cpu) == "1,000 tokens/s (500 per rank, padding counted)"
    unknown = S.SpeedBasis(ranks=8, gpus=8, gpu="Tesla V100-SXM2-32GB", params=10**9)
    assert unknown.mfu(1000) is None and unknown.mfu_basis() == (
        "MFU unknown: no dense bf16 peak known for Tesla V100-SXM2-32GB and no burn-in measured them (`ftbundle "
        "check --burn-in JOB` does: runs after it count MFU against its bf16 GEMM)")


def test_the_basis_comes_from_the_checks_facts():
    hosts = [facts("node0", gpus=smi("h100-health.csv"), model={"params": 10**9}),
             facts("node1", 1, gpus=smi("h100-health.csv"))]
    basis = S.basis_of(ClusterFacts(hosts), 2, False, uses_gpus=True)
    assert (basis.gpus, basis.gpu, basis.peak_tflops, basis.params) == (2, "H100 SXM", 989.0, 10**9)
    assert S.basis_of(ClusterFacts(hosts), 2, False, uses_gpus=False).gpus == 0
    assert S.basis_of(None, 2, True, uses_gpus=True) == S.SpeedBasis(ranks=2, padding=True)


RECORDED_BURNIN = SMI / "recorded" / "nvidia-h100-80gb-hbm3-x1.burnin.json"  # (a real H100's, 2026-11-27)


def unknown_gpus(uuids: list[str], name: str = "NVIDIA A10G") -> list:
    """GPUs of a kind ftbundle's table does not know (AWS's A10G), with these UUIDs."""
    return [Gpu(name, "580.159.04", 23028, "8.6", str(i), uuid) for i, uuid in enumerate(uuids)]


def test_a_gpu_the_table_does_not_know_counts_mfu_against_the_gemm_a_burn_in_measured_on_it():
    # the burn-in's record, from a real H100 node's figures (bf16 GEMM 677.3 TFLOP/s)
    node = json.loads(RECORDED_BURNIN.read_text())
    figures, errors = figures_of("node0", node)
    report = BurninReport(check_dir="/s/checks/burn-20261203-201000-ab12", figures=figures, nodes={"node0": node})
    report.medians, report.slow = compare(figures)
    at = 1796335800.0  # 2026-12-03 20:10 UTC
    kept = gemm_record(report, "burn-20261203-201000-ab12", at)
    uuid = node["devices"][0]["uuid"]
    assert not errors and kept == {"check": "burn-20261203-201000-ab12", "at": at, "gpus": {
        uuid: {"host": "node0", "device": "GPU 0", "name": "NVIDIA H100 80GB HBM3", "tflops": 677.3,
               "check": "burn-20261203-201000-ab12", "at": at}}}
    # ... a CPU burn-in keeps nothing there
    cpu = BurninReport(figures=[Figure("node0", "cpu", "cpu_gemm_gflops", 64.6, lib="numpy 2.4.6")])
    assert gemm_record(cpu, "c", at) is None
    # the H100 is in the table: the data sheet wins, the burn-in is not read for it
    report.gemm_kept = "/s/checks/gemm.json"
    assert gemm_note(report) is None
    h100 = [facts("node0", gpus=smi("h100-health.csv"), model={"params": 10**9}, gemm=kept)]
    assert S.basis_of(ClusterFacts(h100), 1, False, uses_gpus=True).peak_tflops == 989.0

    # two hosts of GPUs the table does not know, 8 GPUs measured by the burn-in, 8 not
    measured = {f"GPU-a{i}": 60.0 + i for i in range(8)}
    record = {"check": "burn-x", "at": at, "gpus": {u: {"host": "node0", "tflops": v} for u, v in measured.items()}}
    hosts = [facts("node0", gpus=unknown_gpus(list(measured)), model={"params": 8_030_261_248}, gemm=record),
             facts("node1", 1, gpus=unknown_gpus([f"GPU-b{i}" for i in range(8)]))]
    basis = S.basis_of(ClusterFacts(hosts), 16, False, uses_gpus=True)
    assert (basis.gpu, basis.peak_tflops, basis.gpus) == ("NVIDIA A10G", 63.5, 16)  # (the median of 60..67)
    assert basis.peak_from == ("the median bf16 GEMM the burn-in burn-x measured on 2026-12-03 on 8 of these 16 GPUs "
                               "(NVIDIA A10G has no data-sheet peak in ftbundle's table)")
    # MFU by hand: 6 x 8.03e9 x 1,000 tokens/s / (16 x 63.5e12) = 4.74%
    assert basis.mfu(1000) == pytest.approx(6 * 8_030_261_248 * 1000 / (16 * 63.5e12))
    assert f"{basis.mfu(1000):.2%}" == "4.74%"
    assert basis.mfu_basis().endswith("over 16 x NVIDIA A10G at 63.5 TFLOP/s, the median bf16 GEMM the burn-in "
                                      "burn-x measured on 2026-12-03 on 8 of these 16 GPUs (NVIDIA A10G has no "
                                      "data-sheet peak in ftbundle's table)")
    assert S.SpeedBasis.from_record(basis.record()) == basis  # (plan.json keeps it: `runs` counts the same)
    # none of the run's GPUs measured, no record, a record that could not be read: MFU unknown, said
    other = [facts("node0", gpus=unknown_gpus(["GPU-c0"]), model={"params": 10**9}, gemm=record)]
    for host in (other, [facts("node0", gpus=unknown_gpus(["GPU-a0"]), model={"params": 10**9})]):
        unknown = S.basis_of(ClusterFacts(host), 1, False, uses_gpus=True)
        assert unknown.peak_tflops is None and unknown.mfu(1000) is None and unknown.no_peak is None
        assert unknown.mfu_basis().startswith("MFU unknown: no dense bf16 peak known for NVIDIA A10G and no burn-in")
    broken = [facts("node0", gpus=unknown_gpus(["GPU-a0"]), model={"params": 10**9},
                    gemm={"error": "/s/checks/gemm.json: not JSON (Expecting value: line 1 column 1 (char 0))"})]
    said = S.basis_of(ClusterFacts(broken), 1, False, uses_gpus=True).mfu_basis()
    assert said.endswith("; the burn-in's record could not be read: /s/checks/gemm.json: not JSON (Expecting value: "
                         "line 1 column 1 (char 0))"), said
    # measured figures that are not numbers count for nothing
    odd = {"check": "x", "gpus": {"GPU-a0": {"tflops": "fast"}, "GPU-a1": {"tflops": 0}, "GPU-a2": None}}
    assert S.measured_peak(odd, ["GPU-a0", "GPU-a1", "GPU-a2"]) is None


def test_a_burn_in_of_part_of_the_fleet_keeps_the_figures_earlier_burn_ins_measured_on_the_rest():
    # burn-in A measured node0 and node1 (8 GPUs each) on 2026-12-01; burn-in B only node1, two days later
    day = 86400.0
    a_at, b_at = 1796335800.0 - 2 * day, 1796335800.0
    first = BurninReport(figures=[Figure(f"node{h}", f"GPU {g}", "gemm_bf16_tflops", 60.0 + g, uuid=f"GPU-{h}{g}")
                                  for h in (0, 1) for g in range(8)])
    a = gemm_record(first, "burn-a", a_at)
    again = BurninReport(figures=[Figure("node1", f"GPU {g}", "gemm_bf16_tflops", 50.0, uuid=f"GPU-1{g}")
                                  for g in range(8)])
    b = gemm_record(again, "burn-b", b_at, kept=a)
    assert len(b["gpus"]) == 16 and (b["check"], b["at"]) == ("burn-b", b_at)
    assert b["gpus"]["GPU-00"] == a["gpus"]["GPU-00"]  # node0's, as A measured them
    assert b["gpus"]["GPU-13"] == {"host": "node1", "device": "GPU 3", "name": None, "tflops": 50.0,
                                   "check": "burn-b", "at": b_at}  # node1's, replaced by B's
    # a run on both hosts: the median of 8 x 50 (B) and 60..67 (A) = 55.0, both burn-ins named, newest first
    peak, said = S.measured_peak(b, [f"GPU-{h}{g}" for h in (0, 1) for g in range(8)])
    assert peak == 55.0
    assert said == ("the median bf16 GEMM the burn-ins burn-b on 2026-12-03 (8), burn-a on 2026-12-01 (8) "
                    "measured on 16 of these 16 GPUs")
    # a run on node0 only reads A's figures alone
    assert S.measured_peak(b, [f"GPU-0{g}" for g in range(8)]) == (
        63.5, "the median bf16 GEMM the burn-in burn-a measured on 2026-12-01 on 8 of these 8 GPUs")
    # a record kept before each GPU carried its burn-in (stop 63's form): the record's own id and time
    old = {"check": "burn-old", "at": a_at, "gpus": {"GPU-00": {"host": "node0", "tflops": 61.0}}}
    merged = gemm_record(again, "burn-b", b_at, kept=old)
    assert merged["gpus"]["GPU-00"] == {"check": "burn-old", "at": a_at, "host": "node0", "tflops": 61.0}
    assert S.measured_peak(old, ["GPU-00"])[1].startswith("the median bf16 GEMM the burn-in burn-old measured on 2026")
    # nothing kept, or something that is no record: B's alone
    for kept in (None, {"error": "x"}, {"gpus": ["GPU-00"]}):
        assert len(gemm_record(again, "burn-b", b_at, kept=kept)["gpus"]) == 8


def test_a_fleet_of_mixed_gpus_counts_mfu_against_the_sum_of_the_peaks_its_ranks_run_on():
    # node0: 8 x H100 SXM (989), node1: 4 x A100 (312), a rank a GPU: 8 x 989 + 4 x 312 = 9,160 TFLOP/s
    # (the first host's GPU for all twelve said 11,868: an MFU 23% too low, and 'looks right')
    hosts = [facts("node0", gpus=smi("h100-x8.csv"), model={"params": 8_030_261_248}),
             facts("node1", 1, gpus=smi("a100-x4.csv"))]
    basis = S.basis_of(ClusterFacts(hosts), 12, False, uses_gpus=True, nprocs={"node0": 8, "node1": 4})
    assert (basis.gpus, basis.gpu, basis.mix) == (12, "H100 SXM, A100", "8 x H100 SXM at 989 + 4 x A100 at 312 TFLOP/s")
    assert basis.mfu(20_000) == pytest.approx(6 * 8_030_261_248 * 20_000 / (9160e12))
    assert f"{basis.mfu(20_000):.2%}" == "10.52%"
    assert basis.mfu_basis().endswith("over 8 x H100 SXM at 989 + 4 x A100 at 312 TFLOP/s dense bf16 (their sum; "
                                      "a GPU's mean 763.333)"), basis.mfu_basis()
    assert S.SpeedBasis.from_record(basis.record()) == basis
    # two ranks a host: only the GPUs they run on count; a host of mixed GPUs (two H100, then an A100)
    # and the job's CUDA_VISIBLE_DEVICES choosing its A100 first
    two = S.basis_of(ClusterFacts(hosts), 4, False, uses_gpus=True, nprocs={"node0": 2, "node1": 2})
    assert (two.mix, two.peak_tflops) == ("2 x H100 SXM at 989 + 2 x A100 at 312 TFLOP/s", 650.5)
    mixed = [facts("node0", gpus=smi("mixed-h100-a100.csv"), model={"params": 10**9})]
    assert S.basis_of(ClusterFacts(mixed), 2, False, uses_gpus=True, nprocs={"node0": 2}).mix is None  # (H100 x 2)
    picked = S.basis_of(ClusterFacts(mixed), 2, False, uses_gpus=True, nprocs={"node0": 2},
                        env={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert picked.mix == "1 x A100 at 312 + 1 x H100 SXM at 989 TFLOP/s"
    # one kind the table does not know, and no burn-in of it: the whole fleet's MFU unknown, that GPU named
    odd = [facts("node0", gpus=smi("h100-x8.csv"), model={"params": 10**9}),
           facts("node1", 1, gpus=unknown_gpus(["GPU-b0"]))]
    unknown = S.basis_of(ClusterFacts(odd), 2, False, uses_gpus=True, nprocs={"node0": 1, "node1": 1})
    assert unknown.mfu(1000) is None and unknown.mfu_basis().startswith(
        "MFU unknown: no dense bf16 peak known for NVIDIA A10G and no burn-in measured them")
    # ... measured by a burn-in: counted against the table's peak and the measured GEMM together
    gemm = {"check": "burn-x", "at": 1796335800.0, "gpus": {"GPU-b0": {"tflops": 61.2}}}
    rank0 = facts("node0", gpus=smi("h100-x8.csv"), model={"params": 10**9}, gemm=gemm)  # (rank 0's probe reads it)
    both = S.basis_of(ClusterFacts([rank0, odd[1]]), 2, False, uses_gpus=True, nprocs={"node0": 1, "node1": 1})
    assert both.mix == "1 x H100 SXM at 989 + 1 x NVIDIA A10G at 61.2 TFLOP/s" and both.peak_tflops == 525.1
    assert both.mfu_basis().endswith("(their sum; a GPU's mean 525.1), the median bf16 GEMM the burn-in burn-x "
                                     "measured on 2026-12-03 on 1 of these 1 GPUs (NVIDIA A10G has no data-sheet "
                                     "peak in ftbundle's table)"), both.mfu_basis()


def test_the_burn_in_says_which_gpus_later_runs_count_mfu_for_against_its_gemm():
    node = json.loads(RECORDED_BURNIN.read_text())
    node["devices"][0]["name"] = "NVIDIA A10G"
    figures, _ = figures_of("node0", node)
    report = BurninReport(check_dir="/s/checks/b", figures=figures, nodes={"node0": node})
    report.medians, report.slow = compare(figures)
    assert gemm_note(report) is None  # (nothing kept: nothing said)
    report.gemm_kept = "/s/checks/gemm.json"
    assert gemm_note(report) == ("NVIDIA A10G: not in ftbundle's table of data-sheet bf16 peaks; later runs on these "
                                 "GPUs count MFU against the bf16 GEMM measured here (median 677 TFLOP/s), kept in "
                                 "/s/checks/gemm.json")


def test_a_run_on_gpus_the_table_does_not_know_says_its_mfu_basis_before_it_starts(tmp_path):
    lora = job_of(tmp_path, train={"llamafactory": {"model_name_or_path": "org/model", "output_dir": "/shared/out",
                                                    "stage": "sft", "finetuning_type": "lora"}})
    layout = make_layout(lora, [Host("node0", "10.0.0.10")], "r1")
    measured = {"check": "burn-x", "at": 1796335800.0, "gpus": {"GPU-a0": {"tflops": 61.2}}}

    def mfu_notes(gpus, gemm, job_layout=layout):
        model = {"params": 10**9} if job_layout is layout else None  # (a script's model is not counted)
        plan = make_plan(job_layout, ClusterFacts([facts("node0", gpus=gpus, model=model, gemm=gemm)]))
        return plan, [n for n in plan.notes if n.startswith("MFU")]

    plan, said = mfu_notes(unknown_gpus(["GPU-a0"]), measured)
    assert plan.speed.peak_tflops == 61.2 and said == [
        "MFU counted against 61.2 TFLOP/s, the median bf16 GEMM the burn-in burn-x measured on 2026-12-03 on 1 of "
        "these 1 GPUs (NVIDIA A10G has no data-sheet peak in ftbundle's table)"]
    _, said = mfu_notes(unknown_gpus(["GPU-a0"]), None)
    assert len(said) == 1 and said[0].startswith("MFU unknown: no dense bf16 peak known for NVIDIA A10G"), said
    # GPUs the table knows: nothing said before the run (the summary says the basis)
    _, said = mfu_notes(smi("h100-health.csv"), measured)
    assert said == []
    # a script's model is not counted (no MFU): nothing said of its peak, which plan.json still keeps
    script = make_layout(job_of(tmp_path), [Host("node0", "10.0.0.10")], "r1")
    plan, said = mfu_notes(unknown_gpus(["GPU-a0"]), measured, script)
    assert said == [] and plan.to_dict()["speed"]["peak_tflops"] == 61.2


def record(step: int, tokens: int, elapsed: str) -> dict:
    return {"current_steps": step, "total_steps": 40, "loss": 1.0, "lr": 1e-4, "epoch": 0.1,
            "elapsed_time": elapsed, "remaining_time": "0:00:10", "throughput": 0, "total_tokens": tokens}


def test_tokens_per_second_on_the_live_line_the_summary_summary_json_and_runs():
    basis = S.SpeedBasis(ranks=8, gpus=8, gpu="H100 SXM", peak_tflops=989.0, params=8_030_261_248, padding=False)
    p = Progress(speed=basis)
    p.feed_record(record(10, 248_000, "0:00:10"))
    p.feed_record(record(20, 496_000, "0:00:20"))
    assert p.tokens_per_s() == 24_800 and p.mfu() == pytest.approx(0.1510, abs=1e-4)
    fields = dict(status_fields(p, 1, 1))
    assert fields["tok/s"] == "24,800" and fields["mfu"] == "15.1%"
    lines = closing_summary(run_id="r", run_dir="/d", duration_s=30, progress=p, output_dir=None, adapter=None,
                            nnodes=1)
    assert "  tokens       24,800 tokens/s (3,100 per GPU, padding not counted)" in lines
    assert any(line.startswith("  MFU          15.1%: 6 x 8.03B parameters per token") for line in lines), lines
    rec = speed_record(p)
    assert rec["tokens"] == 496_000 and rec["tokens_per_s"] == 24_800 and rec["tokens_per_s_per_rank"] == 3100
    assert rec["mfu"] == pytest.approx(0.1510, abs=1e-4) and rec["tokens_padding"] is False
    files = {"plan.json": '{"nodes": [{"host": "node0"}], "job": "j"}',
             "summary.json": '{"state": "finished", "exit_code": 0, "tokens_per_s": 24800.0, '
                             '"tokens_per_s_per_rank": 3100.0, "mfu": 0.1509}'}
    row = run_row("j-20261129-010203-abcd", files)
    assert (row.tokens_per_s, row.tokens_per_s_per_rank, row.mfu) == (24800.0, 3100.0, 0.1509)
    header, line = format_runs([row]).splitlines()
    assert "TOKENS/S  PER RANK  MFU" in header and "24,800    3,100     15.1%" in line, (header, line)


def test_a_resumed_attempt_counts_from_its_own_first_record():
    """A resumed trainer's count holds the steps before the checkpoint (restored with its state)
    while its clock starts again: this attempt's rate is the difference of its own records."""
    p = Progress(start_step=20, speed=S.SpeedBasis(ranks=2))
    p.feed_record(record(25, 600_000, "0:00:05"))  # (500,000 of them before the checkpoint)
    assert p.tokens_per_s() is None  # (one record: no interval yet)
    p.feed_record(record(30, 700_000, "0:00:10"))
    assert p.tokens_per_s() == 20_000
    fresh = Progress()
    fresh.feed_record(record(10, 50_000, "0:00:10"))
    assert fresh.tokens_per_s() == 5000 and fresh.mfu() is None
    fresh.feed_record({**record(11, 55_000, "0:00:11"), "throughput": 5123.45})  # (LlamaFactory's, to the ms)
    assert fresh.tokens_per_s() == 5123.45
    assert "tok/s" not in dict(status_fields(Progress(), 1, 1))


def test_a_script_counts_its_tokens_through_the_step_clock(tmp_path):
    """StepClock.step_done(tokens=N): each rank's count (from its first counted step on) and its
    own clock travel in its step-times line; the launcher sums the ranks' rates. Without tokens
    the line is as before (four fields)."""
    import time as _time

    from ftbundle.protocol import parse_steps
    from ftbundle.shims.steptimes import StepClock
    from ftbundle.ui.progress import Progress

    lines = []
    for rank in ("0", "1"):
        clock = StepClock(str(tmp_path / "a1.steps"), rank)
        for _ in range(6):
            clock.begin()
            clock.mark()
            _time.sleep(0.02)
            clock.step_done(tokens=512)
        clock.finish()
        lines.append((tmp_path / f"a1.steps.{rank}").read_text().strip())
    ranks = parse_steps(";".join(lines))
    assert [(r.local_rank, r.steps, r.tokens) for r in ranks] == [(0, 6, 2560), (1, 6, 2560)]  # (5 steps after the first)
    # (5 sleeps of 20 ms at least; a loaded machine stretches them: 0.7 s seen beside a Molecule run, so
    # the bound above only catches a unit mistake, milliseconds for seconds)
    assert all(0.09 <= r.tokens_s <= 5.0 for r in ranks), ranks
    p = Progress()
    p.feed_steps("node0", lines[0])
    p.feed_steps("node1", lines[1])
    rate = p.tokens_per_s()
    assert rate == pytest.approx(sum(r.tokens / r.tokens_s for r in ranks))
    assert 2 * 512 / 5.0 <= rate <= 2 * 512 / 0.02  # about 2 x 512 tokens every 20 ms
    plain = StepClock(str(tmp_path / "b.steps"), "0")
    plain.begin()
    plain.mark()
    plain.step_done()
    plain.finish()
    assert len((tmp_path / "b.steps.0").read_text().split()) == 4
    assert Progress().tokens_per_s() is None


def test_a_versions_leading_numbers_are_what_every_version_rule_compares():
    """units.release: the one reading of a version for token_setting, nccl_debug_env and the
    trackers (each had its own: a regex of digit runs, a regex of two numbers, a split)."""
    from ftbundle.units import release

    assert release("2.8.0+cu126") == (2, 8, 0)
    assert release("4.57.0.dev0") == (4, 57, 0)
    assert release("2.7rc1") == (2, 7)
    assert release("5") == (5,)
    assert release(None) == () and release("") == () and release("absent") == ()


def test_a_run_past_its_first_day_keeps_its_clock():
    """LlamaFactory's elapsed_time and remaining_time are str(timedelta): "1 day, 0:00:05" from the
    second day on. Read as H:MM:SS they were no time at all: the run's tokens/s and samples/s froze
    at their first day's figures, and its ETA was gone."""
    p = Progress()
    p.feed_record({"current_steps": 100, "total_steps": 1000, "loss": 1.0, "elapsed_time": "23:59:50",
                   "remaining_time": "9 days, 0:00:00", "total_tokens": 1_000_000})
    p.feed_record({"current_steps": 200, "total_steps": 1000, "loss": 1.0, "elapsed_time": "2 days, 0:00:00",
                   "remaining_time": "8 days, 0:00:00", "total_tokens": 1_728_000_000})
    assert p.elapsed_s == 2 * 86400 and p.remaining_s == 8 * 86400
    assert p.tokens_per_s() == 1_728_000_000 / (2 * 86400)
    assert p.steps_per_s() == 200 / (2 * 86400)


def test_a_week_of_records_keeps_an_even_bounded_curve_and_its_last_point():
    """A week at one record a second is 604,800 records: all kept, the launcher held about 180 MB
    and sent them at the end. The plot's curve now keeps at most RECORDS_MAX, evenly spaced, and
    ends on the run's last record; the live line's clock says days."""
    import tracemalloc

    from ftbundle.ui.progress import RECORDS_MAX, clock

    p = Progress()
    n = 5 * RECORDS_MAX + 7
    tracemalloc.start()
    for step in range(1, n + 1):
        p.feed_record({"current_steps": step, "total_steps": n, "loss": 1.0 + 1 / step, "lr": 1e-4,
                       "epoch": step / n, "elapsed_time": f"{step // 3600}:{step // 60 % 60:02d}:{step % 60:02d}"})
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    curve = p.plot_records()
    steps = [r["current_steps"] for r in curve]
    assert RECORDS_MAX // 2 <= len(p.records) <= RECORDS_MAX, len(p.records)
    assert steps[0] == 1 and steps[-1] == n and p.final_loss == 1.0 + 1 / n
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
    assert gaps == {8}, gaps  # (100,007 records: halved three times, every 8th kept)
    assert steps[-1] - steps[-2] <= 8
    assert held < 16 * 2**20, held  # (all 100,007 as before: about 30 MB)
    assert [clock(s) for s in (59, 3599, 86399, 86400, 7 * 86400 - 1)] == [
        "00:59", "59:59", "23:59:59", "1d 00:00:00", "6d 23:59:59"]


def test_the_curve_of_a_short_run_is_every_record():
    p = Progress()
    for step in (1, 2, 3):
        p.feed_record({"current_steps": step, "total_steps": 3, "loss": float(step)})
    p.feed_record({"current_steps": 3, "total_steps": 3, "train_runtime": 1.0})  # (the end: no loss)
    assert [r["current_steps"] for r in p.plot_records()] == [1, 2, 3] == [r["current_steps"] for r in p.records]


def test_rank_0s_probe_reads_the_burn_ins_record_and_nothing_else_asks_it(tmp_path):
    from ftbundle.check import probe_spec
    from ftbundle.remote import probe

    lora = job_of(tmp_path, train={"llamafactory": {"model_name_or_path": "org/model", "output_dir": "/shared/out"}})
    two = [Host("node0", "10.0.0.10"), Host("node1", "10.0.0.11")]

    def asked(job, rank):
        return probe_spec(make_layout(job, two, "r1"), rank, token=None, expect=None, port_peers=None).get("gemm")

    assert asked(lora, 0) == "/shared/checks/gemm.json" and asked(lora, 1) is None
    assert asked(job_of(tmp_path), 0) == "/shared/checks/gemm.json"  # (a script may count its tokens)
    assert asked(job_of(tmp_path, gpus_per_node=0), 0) is None  # (a CPU job asks nothing)
    assert asked(job_of(tmp_path, train={"command": "true"}), 0) is None  # (a command job has no speed)

    path = tmp_path / "gemm.json"

    def read():
        out = {}
        probe.gemm({"gemm": str(path)}, out)
        return out.get("gemm")

    assert read() is None  # (no burn-in yet: no record, nothing said)
    kept = {"check": "burn-x", "at": 1796335800.0, "gpus": {"GPU-a0": {"host": "node0", "tflops": 61.2}}}
    path.write_text(json.dumps(kept))
    assert read() == kept
    path.write_text("{\"check\": ")
    assert read()["error"].startswith(f"{path}: not JSON (")
    path.write_text("[]")
    assert read() == {"error": f"{path}: not a JSON object"}
    path.write_bytes(b" " * (probe.GEMM_MAX_BYTES + 1))
    assert read() == {"error": f"{path}: over 4 MB, not read"}
    path.unlink()
    path.mkdir()
    assert read() == {"error": f"{path}: Is a directory"}
