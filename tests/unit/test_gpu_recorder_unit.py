"""The GPU tests' nvidia-smi recorder (tests/gpu/test_gpu.py) without a GPU: the replaying
stand-in plays nvidia-smi."""

from __future__ import annotations

import os
import shutil

from tests.unit.test_check_unit import REPLAY, SMI
from tests.gpu.test_gpu import QUERIES, record_nvidia_smi


def test_the_recorder_writes_what_nvidia_smi_prints(tmp_path):
    """The recorder itself, without a GPU: the replaying stand-in plays nvidia-smi (its
    hand-made a100-x4 sample), and what is written is byte for byte what it printed."""
    bin_dir, data = tmp_path / "bin", tmp_path / "smi"
    bin_dir.mkdir()
    shutil.copy(REPLAY, bin_dir / "nvidia-smi")
    shutil.copytree(SMI, data, ignore=shutil.ignore_patterns("recorded"))
    (data / "sample").write_text("a100-x4")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FTB_SMI_DIR": str(data)}
    sample, _ = record_nvidia_smi(tmp_path / "out", env=env)
    assert sample == "nvidia-a100-sxm4-80gb-x4"
    for suffix in QUERIES:
        assert (tmp_path / "out" / f"{sample}{suffix}").read_bytes() == (SMI / f"a100-x4{suffix}").read_bytes()
    assert "`nvidia-a100-sxm4-80gb-x4.*`: recorded" in (tmp_path / "out" / "SOURCES.md").read_text()
