"""GPU health in the check (issue 37, item 1), without hosts: nvidia-smi's real health
readings of an H100 (tests/data/nvidia-smi/health/, copied from a lent GPU machine) parsed,
faults made from them by the documented edits (tests/data/nvidia-smi/README.md) named on the
right host and GPU, refused or warned as the job's `health` says; the probe run for real on this
machine with the stand-ins (nvidia-smi-replay, dmesg-replay) replaying those readings.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
from pathlib import Path

import pytest

from ftbundle import gpu_health as H
from ftbundle.check import probe_spec
from ftbundle.check import rules as R
from ftbundle.check.report import CheckReport, format_report
from ftbundle.errors import UserError
from ftbundle.facts import ClusterFacts, parse_facts
from tests.unit.test_check_unit import (
    REPLAY,
    SMI,
    facts,
    hosts,
    job_of,
    layout_of,
    local_spec,
    run_probe,
)

RECORDED = SMI / "recorded"  # what tests/gpu/test_gpu.py recorded on lent GPU machines
REAL = SMI / "health"  # verbatim copies of the recorded H100 readings
SAMPLE = "h100-health"  # what the stand-in replays: the real readings (README: two columns added)
UUID = "GPU-0e7e2459-5537-7ce0-d915-6c9a8d0e0338"
DMESG_REPLAY = REPLAY.parent / "dmesg-replay"
XID79 = "NVRM: Xid (PCI:0000:00:06): 79, pid=2816, name=python3, GPU has fallen off the bus."


def edit(text: str, **cells: str) -> str:
    """The documented fault edits: the health CSV with some cells of every row changed, by
    column name (`remapped_rows.pending="Yes"`)."""
    rows = list(csv.reader(io.StringIO(text), skipinitialspace=True))
    names = [c.split(" [")[0] for c in rows[0]]
    for key, value in cells.items():
        col = names.index(key.replace("__", "."))
        for row in rows[1:]:
            row[col] = value
    return "".join(", ".join(r) + "\n" for r in rows)


def two_gpus(text: str) -> str:
    """The real one-GPU reading as a two-GPU host: the row again as GPU 1 (another UUID, bus 07)."""
    header, row = text.splitlines()
    second = row.replace("0, GPU-0e7e", "1, GPU-1e7e", 1).replace("00000000:00:06.0", "00000000:00:07.0")
    return f"{header}\n{row}\n{second}\n"


def health_of(query: str, xid_lines: tuple[str, ...] = (), uptime: float = 1000.0, temperature: str | None = None):
    return {"query": query, "temperature": temperature if temperature is not None else
            (SMI / f"{SAMPLE}.temperature.txt").read_text(),
            "kernel_log": {"lines": list(xid_lines), "uptime_s": uptime}}


def host(name: str, rank: int, query: str | None = None, **kw):
    data = {"hostname": name, "health": health_of(query or (SMI / f"{SAMPLE}.health.csv").read_text(), **kw)}
    return parse_facts(name, rank, data)


# ---------------------------------------------------------------------------------------
# nvidia-smi's real formats


def test_the_real_h100_readings_parse_into_every_field():
    """query-gpu-health.csv exactly as nvidia-smi printed it (header, units, `[N/A]`, the
    field's new name in the header): every field it has is read, none is invented."""
    (g,) = H.parse_health_csv((REAL / "query-gpu-health.csv").read_text())
    assert (g.index, g.uuid, g.ecc_mode, g.ecc_uncorrected) == ("0", UUID, "Enabled", 0)
    assert (g.remap_pending, g.remap_failure, g.retired_pages_pending) == (False, False, None)  # [N/A]: unknown
    assert (g.clock_events, g.sm_clock_mhz, g.sm_clock_max_mhz, g.temperature_c) == (0x1, 345, 1980, 44)
    assert (g.pcie_gen, g.pcie_width, g.pcie_width_max) == (5, 16, 16)
    assert g.pcie_gen_max is None and g.bus_id is None  # not in that recording's query
    assert H.gpu_findings("h", g) == []  # an idle, healthy H100
    # without pci.bus_id in the query, the -q blocks (in nvidia-smi's GPU order) give it
    (g,) = H.with_temperatures([g], (REAL / "nvidia-smi-q-d-health.txt").read_text())
    assert (g.bus_id, g.tlimit_c, g.slowdown_tlimit_c) == ("00000000:00:06.0", 43, -2)


def test_the_replayed_sample_is_the_real_reading_plus_two_columns_from_its_q_output():
    real = (REAL / "query-gpu-health.csv").read_text().splitlines()
    sample = (SMI / f"{SAMPLE}.health.csv").read_text().splitlines()
    assert sample == [real[0] + ", pcie.link.gen.max, pci.bus_id", real[1] + ", 5, 00000000:00:06.0"]
    q = (REAL / "nvidia-smi-q.txt").read_text()  # where the two values come from
    assert "Bus Id                                         : 00000000:00:06.0" in q
    assert "PCIe Generation\n                Max                                    : 5" in q
    assert (SMI / f"{SAMPLE}.temperature.txt").read_text() == (REAL / "nvidia-smi-q-d-health.txt").read_text()
    assert (SMI / f"{SAMPLE}.dmesg.txt").read_text() == (REAL / "dmesg-nvrm.txt").read_text()
    assert H.HEALTH_QUERY.split(",")[:17] == [  # the probe asks what was recorded, then the two
        c.split(" [")[0] for c in real[0].split(", ")[:9]] + ["clocks_throttle_reasons.active", "clocks.sm",
                                                              "clocks.max.sm", "temperature.gpu", "power.draw",
                                                              "pcie.link.gen.current", "pcie.link.width.current",
                                                              "pcie.link.width.max"]


def test_the_real_temperature_section_gives_hoppers_t_limit_margins():
    """An H100 (driver 580) reports temperatures as margins to T.Limit: 43 C below it now,
    slowdown at -2 C. Older GPUs give absolute thresholds; both are read."""
    ((bus, temps),) = H.parse_temperatures((REAL / "nvidia-smi-q-d-health.txt").read_text())
    assert bus == "00000000:00:06.0"
    assert temps["GPU Current Temp"] == 44 and temps["GPU T.Limit Temp"] == 43
    assert temps["GPU Slowdown T.Limit Temp"] == -2 and temps["GPU Target Temperature"] is None  # N/A
    f = host("n", 0)
    assert (f.gpu_health[0].tlimit_c, f.gpu_health[0].slowdown_tlimit_c, f.gpu_health[0].at_slowdown) == (43, -2, False)
    hot = (REAL / "nvidia-smi-q-d-health.txt").read_text().replace(
        "GPU T.Limit Temp                               : 43 C", "GPU T.Limit Temp                               : -3 C")
    assert host("n", 0, temperature=hot).gpu_health[0].at_slowdown
    old = "GPU 00000000:3B:00.0\n    Temperature\n        GPU Current Temp            : 89 C\n" \
          "        GPU T.Limit Temp            : N/A\n        GPU Slowdown Temp           : 89 C\n"
    g = H.with_temperatures([H.GpuHealth("0", bus_id="00000000:3B:00.0", temperature_c=89)], old)[0]
    assert g.at_slowdown and g.slowdown_c == 89 and g.tlimit_c is None
    (found,) = H.gpu_findings("n", g)
    assert found.reading == "temperature at its slowdown threshold (89 C, slowdown at 89 C)" and not found.fatal


def test_the_probes_own_health_query_on_a_real_h100_reads_every_field():
    """What the probe itself asked and got on a lent H100 (tests/gpu/test_gpu.py, 2026-11-27: no units,
    the reasons under their new name, the two columns the hand-made sample adds): every field
    read, the same columns as the sample the stand-in replays, and a healthy GPU named by nothing."""
    text = (RECORDED / "nvidia-h100-80gb-hbm3-x1.health.csv").read_text()
    names = lambda t: [c.split(" [")[0] for c in t.splitlines()[0].split(", ")]  # noqa: E731
    assert names(text) == names((SMI / f"{SAMPLE}.health.csv").read_text())
    (g,) = H.with_temperatures(H.parse_health_csv(text),
                               (RECORDED / "nvidia-h100-80gb-hbm3-x1.temperature.txt").read_text())
    assert g.uuid == "GPU-d8da991c-ad10-ca85-a0ea-0b51b3553ee1" and g.bus_id == "00000000:00:06.0"
    assert (g.ecc_mode, g.ecc_uncorrected, g.remap_pending, g.remap_failure) == ("Enabled", 0, False, False)
    assert (g.clock_events, g.sm_clock_max_mhz, g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max) == (
        0x1, 1980, 5, 5, 16, 16)
    assert (g.tlimit_c, g.slowdown_tlimit_c, g.at_slowdown) == (40, -2, False)
    assert H.gpu_findings("h", g) == []


def test_a_real_h100_at_its_power_cap_in_a_burn_in_is_named_by_no_rule_and_a_brake_would_be():
    """The probe's health query every 0.5 s through a 20 s burn-in on a lent H100 (tests/gpu/test_gpu.py):
    the GEMM half runs at the 700 W cap (reason 0x4, SW power cap) with the SM clock pulled down to
    about 1350 of 1980 MHz. That is how a healthy H100 runs a long load, and no rule names it. The
    documented edits on the same busy readings are named: the power brake (0x80) and a link that
    dropped to gen 4 while busy."""
    text = (RECORDED / "nvidia-h100-80gb-hbm3-x1.under-load.health.csv").read_text()
    readings = H.parse_health_csv(text)
    capped = [g for g in readings if g.clock_events == 0x4]
    assert len(capped) >= 20 and max(g.sm_clock_mhz for g in capped) < 1500 <= capped[0].sm_clock_max_mhz
    assert [f.reading for g in readings for f in H.gpu_findings("h", g)] == []
    braked = H.parse_health_csv(text.replace(", 0x0000000000000004, ", ", 0x0000000000000084, "))
    named = [f for g in braked for f in H.gpu_findings("h", g)]
    assert len(named) == len(capped) and {f.kind for f in named} == {"clocks cut"}
    assert named[0].reading == "clock event reasons 0x84 (HW power brake slowdown), SM 1410 of 1980 MHz"
    slower = H.parse_health_csv(edit(text, pcie__link__gen__current="4"))
    kinds = [(g.clock_events, f.kind) for g in slower for f in H.gpu_findings("h", g)]
    assert kinds and all(k == "PCIe gen" and not reasons & H.IDLE_REASON for reasons, k in kinds)
    assert len(kinds) == sum(1 for g in slower if not g.clock_events & H.IDLE_REASON)  # busy ones only


def test_the_node_programs_kernel_log_read_on_a_real_h100_names_an_xid_by_uuid():
    """node.sh's `xids` answer as it came from a lent H100 (tests/gpu/test_gpu.py): the GPU by index,
    UUID and bus; no Xid. With an Xid 79 line added, stamped 10 s before, the GPU is named fatal."""
    text = (RECORDED / "nvidia-h100-80gb-hbm3-x1.xids.txt").read_text()
    gpus, xids = H.parse_xids_report(text)
    assert [(g.index, g.uuid, g.bus_id) for g in gpus] == [("0", "GPU-d8da991c-ad10-ca85-a0ea-0b51b3553ee1",
                                                            "00000000:00:06.0")] and xids == []
    gpus, xids = H.parse_xids_report(text + f"[  147.98] {XID79}\n")
    (found,) = H.xid_findings("node1", gpus, xids)
    assert (found.gpu, found.kind, found.fatal) == ("GPU 0 (GPU-d8da991c-ad10-ca85-a0ea-0b51b3553ee1)", "Xid 79", True)
    assert found.reading.startswith("Xid 79 10 s ago")


def test_na_not_supported_and_lost_gpus_read_as_unknown_never_as_zero():
    text = ("index, uuid, ecc.errors.uncorrected.volatile.total, remapped_rows.pending, "
            "clocks_throttle_reasons.active, pcie.link.width.current, pcie.link.width.max\n"
            "0, GPU-a, [N/A], [Not Supported], [N/A], 16, [N/A]\n"
            "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.  Reboot the system to recover this GPU\n"
            "2, GPU-c, [Unknown Error], No, 0x0000000000000000, 8, 16\n")
    a, c = H.parse_health_csv(text)
    assert (a.ecc_uncorrected, a.remap_pending, a.clock_events, a.pcie_width_max) == (None, None, None, None)
    assert H.gpu_findings("h", a) == []
    assert c.index == "2" and c.ecc_uncorrected is None and [f.kind for f in H.gpu_findings("h", c)] == ["PCIe width"]
    with pytest.raises(ValueError):
        H.parse_health_csv("No devices were found\n")


def test_xid_lines_from_dmesg_and_the_journal_with_their_age():
    lines = [f"[  940.250000] {XID79}",
             "[  900.1] host kernel: NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x50",  # journalctl -k
             "NVRM: Xid (PCI:0000:3b:00.0): 48, An uncorrectable double bit error (DBE) has been detected",  # no stamp
             "[    0.518730] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04"]
    x79, x13, x48 = H.parse_xids(lines, 1000.0)
    assert (x79.code, x79.pci, x79.age_s) == (79, "0000:00:06", pytest.approx(59.75))
    assert (x13.code, x13.pci, x13.age_s) == (13, "0000:3b:00", pytest.approx(99.9))
    assert (x48.code, x48.age_s) == (48, None)
    assert H.pci_key("0000:3b:00") == H.pci_key("00000000:3B:00.0") == (0, 0x3B, 0)
    assert H.parse_xids((REAL / "dmesg-nvrm.txt").read_text().splitlines(), 5.0) == []  # the real log: no Xid


# ---------------------------------------------------------------------------------------
# the documented faults, each on the right host and GPU


FAULTS = {  # name -> (edit of the real reading, the finding's kind, refuses)
    "uncorrectable ECC": ({"ecc.errors.uncorrected.volatile.total": "2"}, "uncorrectable ECC", True),
    "pending remap": ({"remapped_rows.pending": "Yes"}, "remap pending", True),
    "remapping failure": ({"remapped_rows.failure": "Yes"}, "remap failure", True),
    "pages pending retirement": ({"retired_pages.pending": "Yes"}, "retirement pending", True),
    "HW slowdown": ({"clocks_event_reasons.active": "0x0000000000000008"}, "clocks cut", False),
    "PCIe x8 of x16": ({"pcie.link.width.current": "8"}, "PCIe width", False),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_documented_fault_is_named_on_its_host_and_gpu(name, tmp_path):
    cells, kind, fatal = FAULTS[name]
    real = (SMI / f"{SAMPLE}.health.csv").read_text()
    sick = two_gpus(real)
    header, gpu0, gpu1 = sick.splitlines()
    sick = f"{header}\n{gpu0}\n{edit(header + chr(10) + gpu1, **cells).splitlines()[1]}\n"  # GPU 1 only
    fleet = ClusterFacts([host(f"node{i}", i, two_gpus(real)) for i in range(4)] + [host("node4", 4, sick)])
    layout = layout_of(tmp_path, n=5)
    check = R.check_health(fleet.hosts, "refuse")
    found = [x for f in fleet.hosts for x in H.findings(f.host, f.gpu_health, f.xids)]
    assert [(x.host, x.index, x.kind, x.fatal) for x in found] == [("node4", "1", kind, fatal)]
    line = f"node4: GPU 1 (GPU-1e7e2459-5537-7ce0-d915-6c9a8d0e0338): {found[0].reading}: {found[0].meaning}"
    if fatal:
        assert not check.ok and check.details == [line] and check.warnings == []
        assert check.messages() == [f"gpu_health: {line}"]
    else:
        assert check.ok and check.warnings == [line]
    assert check.groups[0] == ("2 GPU(s) healthy", ["node0", "node1", "node2", "node3"])
    assert check.groups[1][1] == ["node4"]
    # `health: warn`: the same finding, never a failure; `off`: not asked at all
    warned = R.check_health(fleet.hosts, "warn")
    assert warned.ok and warned.warnings == [line]
    assert R.check_health(fleet.hosts, "off") is None
    checks = R.evaluate(layout, fleet, 1)
    assert any(c.name == "gpu_health" for c in checks)


def test_the_readings_of_each_fault_say_what_they_are():
    real = (SMI / f"{SAMPLE}.health.csv").read_text()
    readings = {name: [x.reading for x in H.findings("h", host("h", 0, edit(real, **cells)).gpu_health, [])]
                for name, (cells, _, _) in FAULTS.items()}
    assert readings == {
        "uncorrectable ECC": ["2 volatile uncorrectable ECC error(s)"],
        "pending remap": ["row remapping pending"],
        "remapping failure": ["row remapping failure"],
        "pages pending retirement": ["page retirement pending"],
        "HW slowdown": ["clock event reasons 0x8 (HW slowdown), SM 345 of 1980 MHz"],
        "PCIe x8 of x16": ["PCIe link x8 of x16"],
    }
    thermal = edit(real, clocks_event_reasons__active="0x00000000000000E0")
    (cut,) = H.findings("h", host("h", 0, thermal).gpu_health, [])
    assert "SW thermal slowdown, HW thermal slowdown, HW power brake slowdown" in cut.reading
    # a slower link warns only on a busy GPU: an idle one may lower its speed to save power
    assert H.findings("h", host("h", 0, edit(real, pcie__link__gen__current="1")).gpu_health, []) == []
    busy = edit(real, pcie__link__gen__current="4", clocks_event_reasons__active="0x0000000000000000")
    assert [x.reading for x in H.findings("h", host("h", 0, busy).gpu_health, [])] == ["PCIe link gen 4 of gen 5 (GPU busy)"]
    # SW power cap under load and the idle reason are normal
    assert H.findings("h", host("h", 0, edit(real, clocks_event_reasons__active="0x0000000000000005")).gpu_health, []) == []


def test_an_xid_79_in_the_kernel_log_refuses_naming_the_gpu_by_its_pci_address(tmp_path):
    real = (SMI / f"{SAMPLE}.health.csv").read_text()
    fleet = [host("node0", 0, two_gpus(real)),
             host("node1", 1, two_gpus(real), xid_lines=(f"[  970.000000] {XID79.replace('00:06', '00:07')}",))]
    check = R.check_health(fleet, "refuse")
    assert check.failure == "GPUs unfit to run (health: refuse)"
    assert check.details == ["node1: GPU 1 (GPU-1e7e2459-5537-7ce0-d915-6c9a8d0e0338): Xid 79 30 s ago "
                             "(pid=2816, name=python3, GPU has fallen off the bus.): GPU has fallen off the bus"]
    assert check.groups == [("2 GPU(s) healthy", ["node0"]), ("unfit: Xid 79", ["node1"])]
    # outside the window: not counted; an application's Xid (13): a warning
    old = host("node1", 1, real, xid_lines=(f"[  1.0] {XID79}",), uptime=H.XID_WINDOW_S + 100.0)
    assert R.check_health([old], "refuse").ok and R.check_health([old], "refuse").warnings == []
    app = host("node1", 1, real, xid_lines=("[  990.0] NVRM: Xid (PCI:0000:00:06): 13, Graphics Exception",))
    check = R.check_health([app], "refuse")
    assert check.ok and check.warnings == [f"node1: GPU 0 ({UUID}): Xid 13 10 s ago (Graphics Exception): "
                                           "graphics engine exception (usually the application's)"]
    # a storm of the same Xid is one finding, with its count and the latest line's words
    storm = host("node1", 1, real, xid_lines=tuple(f"[  {900 + i}.0] {XID79.replace('2816', str(2816 + i))}"
                                                   for i in range(5)))
    assert R.check_health([storm], "refuse").details == [
        f"node1: GPU 0 ({UUID}): Xid 79 (5 times, the last 96 s ago) (pid=2820, name=python3, GPU has fallen off "
        "the bus.): GPU has fallen off the bus"]
    # a GPU nvidia-smi no longer lists: named by its address
    lost = host("node2", 2, real, xid_lines=("[  990.0] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",))
    assert R.check_health([lost], "refuse").details == [
        "node2: PCI 0000:3b:00: Xid 79 10 s ago (GPU has fallen off the bus.): GPU has fallen off the bus"]


def test_every_fatal_xid_of_the_issue_is_in_the_documented_table():
    assert {48, 63, 64, 74, 79, 92, 94, 95, 119, 140, 142} <= set(H.FATAL_XIDS)
    assert not set(H.FATAL_XIDS) & set(H.OTHER_XIDS)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "check.md").read_text()
    for code, meaning in H.FATAL_XIDS.items():
        assert f"| {code} | {meaning} |" in docs, code


def test_the_same_fault_on_many_hosts_is_one_folded_line_naming_each_uuid():
    real = (SMI / f"{SAMPLE}.health.csv").read_text()
    fleet = [host(f"gpu-{i:03d}", i, edit(real, remapped_rows__pending="Yes" if i in (4, 5, 6, 10) else "No",
                                         uuid=f"GPU-{i:08x}-0000"))
             for i in range(1, 13)]
    check = R.check_health(fleet, "refuse")
    assert check.details == ["gpu-[004-006,010]: GPU 0 (GPU-00000004-0000, GPU-00000005-0000, GPU-00000006-0000, "
                             "GPU-0000000a-0000): row remapping pending: a bad memory row is remapped only at the "
                             "next GPU reset: reset it"]
    assert check.groups == [("1 GPU(s) healthy", [f"gpu-{i:03d}" for i in (1, 2, 3, 7, 8, 9, 11, 12)]),
                            ("unfit: remap pending", ["gpu-004", "gpu-005", "gpu-006", "gpu-010"])]
    lines = format_report(CheckReport([check]))
    assert lines[0] == "FAIL GPUs unfit to run (health: refuse):" and "1 of 1 checks failed" in lines[-1]


def test_unread_health_warns_and_an_unread_kernel_log_is_a_note():
    f = parse_facts("n0", 0, {"health": {"error": "nvidia-smi did not answer within 10s (hung driver or GPU?)",
                                         "kernel_log": {"error": "dmesg: read kernel buffer failed: Operation not "
                                                                 "permitted; journalctl: not installed"}}})
    check = R.check_health([f, parse_facts("n1", 1, {})], "refuse")
    assert check.ok and check.groups == [("unknown", ["n0"])]  # n1 was not asked (an older probe)
    assert check.warnings == ["GPU health not read on n0: nvidia-smi did not answer within 10s (hung driver or GPU?)"]
    assert check.notes == ["Xid events not read on n0: dmesg: read kernel buffer failed: Operation not permitted; "
                           "journalctl: not installed"]


# ---------------------------------------------------------------------------------------
# the job key


def test_the_health_key_is_refuse_warn_or_off(tmp_path):
    assert job_of(tmp_path).health == "refuse"
    assert job_of(tmp_path, health="warn").health == "warn"
    assert job_of(tmp_path, health=False).health == "off"  # a bare `off` in YAML
    for bad in ("strict", True, 1):
        with pytest.raises(UserError) as exc:
            job_of(tmp_path, health=bad)
        assert exc.value.key == "health" and "must be one of refuse, warn, off" in str(exc.value)
    with pytest.raises(UserError, match="did you mean 'refuse'"):
        job_of(tmp_path, health="refuze")


def test_the_probe_is_asked_for_health_unless_it_is_off(tmp_path):
    layout = layout_of(tmp_path)
    spec = probe_spec(layout, 0, token=None, expect=[0], port_peers=None)
    assert spec["health"]["fields"] == list(H.HEALTH_FIELDS) and spec["health"]["window_s"] == H.XID_WINDOW_S
    assert "health" not in probe_spec(layout_of(tmp_path, health="off"), 0, token=None, expect=[0], port_peers=None)
    assert "health" not in probe_spec(layout, 0, token=None, expect=[0], port_peers=None, create=False)


# ---------------------------------------------------------------------------------------
# the probe, run for real with the stand-ins


def stand_ins(tmp_path: Path, sample: str = SAMPLE, dmesg: str | None = None, refused: bool = False) -> dict:
    """PATH with nvidia-smi-replay and dmesg-replay, fed ``sample`` (and ``dmesg`` as the
    kernel log; ``refused``: dmesg answers as where kernel.dmesg_restrict is 1)."""
    bin_dir, data = tmp_path / "bin", tmp_path / "smi"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(REPLAY, bin_dir / "nvidia-smi")
    shutil.copy(DMESG_REPLAY, bin_dir / "dmesg")
    if data.exists():
        shutil.rmtree(data)
    shutil.copytree(SMI, data)
    (data / "sample").write_text(sample)
    if dmesg is not None:
        (data / f"{sample}.dmesg.txt").write_text(dmesg)
    if refused:
        (data / "dmesg-refused").write_text("")
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FTB_SMI_DIR": str(data)}


def health_spec(tmp_path: Path) -> dict:
    return local_spec(tmp_path, nvidia_smi_timeout_s=5,
                      health={"fields": list(H.HEALTH_FIELDS), "aliases": H.FIELD_ALIASES, "window_s": 3600})


def test_the_probe_reads_the_real_readings_through_the_stand_ins(tmp_path):
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    log = (REAL / "dmesg-nvrm.txt").read_text() + f"[{uptime - 20:12.6f}] {XID79}\n"
    f = parse_facts("node1", 1, run_probe(health_spec(tmp_path), env=stand_ins(tmp_path, dmesg=log)))
    assert f.health_error is None and f.kernel_log_error is None
    (g,) = f.gpu_health
    assert (g.uuid, g.bus_id, g.tlimit_c, g.pcie_gen_max, g.clock_events) == (UUID, "00000000:00:06.0", 43, 5, 1)
    (xid,) = f.xids
    assert xid.code == 79 and 19 <= xid.age_s < 60
    check = R.check_health([f], "refuse")
    assert check.details[0].startswith(f"node1: GPU 0 ({UUID}): Xid 79 ")


def test_the_probe_falls_back_to_the_journal_when_dmesg_is_refused(tmp_path):
    env = stand_ins(tmp_path, refused=True)
    bin_dir = Path(env["PATH"].split(":")[0])
    journal = bin_dir / "journalctl"
    journal.write_text("#!/bin/sh\necho \"$@\" > \"$FTB_SMI_DIR/journal-args\"\n"
                       "echo '[  990.000000] host kernel: NVRM: Xid (PCI:0000:00:06): 48, DBE (0x1,0x0)'\n")
    journal.chmod(0o755)
    f = parse_facts("h", 0, run_probe(health_spec(tmp_path), env=env))
    assert f.kernel_log_error is None and [x.code for x in f.xids] == [48]
    assert (Path(env["FTB_SMI_DIR"]) / "journal-args").read_text().split() == [
        "-k", "-o", "short-monotonic", "--no-pager", "--since=-3600s"]
    journal.write_text("#!/bin/sh\necho 'No journal files were opened due to insufficient permissions.' >&2\n")
    f = parse_facts("h", 0, run_probe(health_spec(tmp_path), env=env))
    assert f.xids == [] and f.kernel_log_error == ("dmesg: read kernel buffer failed: Operation not permitted; "
                                                   "journalctl -k: No journal files were opened due to insufficient "
                                                   "permissions.")
    journal.write_text("#!/bin/sh\necho '-- No entries --'\necho 'No journal files were found.' >&2\n")  # journalctl 252
    f = parse_facts("h", 0, run_probe(health_spec(tmp_path), env=env))
    assert f.kernel_log_error.endswith("; journalctl -k: No journal files were found.")


def test_a_driver_that_does_not_know_a_field_is_asked_without_it(tmp_path):
    """'Field "x" is not a valid field to query.' (an older driver): the deprecated name is
    asked under its new one, an unknown field is left out, the rest still read."""
    env = stand_ins(tmp_path)
    bin_dir = Path(env["PATH"].split(":")[0])
    real_smi = bin_dir / "nvidia-smi-real"
    (bin_dir / "nvidia-smi").rename(real_smi)
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/bash\n"
        "echo \"$@\" >> \"$FTB_SMI_DIR/asked\"\n"
        "case \"$*\" in\n"
        "  *clocks_throttle_reasons.active*) echo 'Field \"clocks_throttle_reasons.active\" is not a valid field to query.'; exit 2 ;;\n"
        "  *pcie.link.gen.max*) echo 'Field \"pcie.link.gen.max\" is not a valid field to query.'; exit 2 ;;\n"
        "  *--query-gpu=index,uuid,name*) cat \"$FTB_SMI_DIR/h100-health.health.csv\"; exit 0 ;;\n"
        "esac\n"
        f"exec {real_smi} \"$@\"\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    f = parse_facts("h", 0, run_probe(health_spec(tmp_path), env=env))
    asked = [line for line in (Path(env["FTB_SMI_DIR"]) / "asked").read_text().splitlines() if "--query-gpu=index,uuid,name" in line]
    assert len(asked) == 3
    assert "clocks_event_reasons.active" in asked[1] and "pcie.link.gen.max" not in asked[2]
    assert f.health_error is None and f.gpu_health[0].uuid == UUID


def test_a_hung_driver_leaves_health_unknown_within_the_timeout(tmp_path):
    f = parse_facts("h", 0, run_probe({**health_spec(tmp_path), "nvidia_smi_timeout_s": 1},
                                      env=stand_ins(tmp_path, sample="hang")))
    assert f.gpu_hung and f.health_error == "nvidia-smi did not answer within 1s (hung driver or GPU?)"
    assert f.kernel_log_error is None  # the kernel log is read all the same (first)


def test_a_host_without_nvidia_smi_is_not_asked_about_gpu_health(tmp_path):
    f = parse_facts("h", 0, run_probe(health_spec(tmp_path)))
    assert not f.health_asked and R.check_health([f], "refuse") is None
    assert hosts(1) and facts("h").health_asked is False
