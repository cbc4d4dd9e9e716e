"""The GPU tests' checks (tests/gpu/test_gpu.py) on the CPU, everywhere: the same LoRA run
through `ftbundle run` and the same step-clock comparison, so that a lent GPU's few minutes
are not spent finding a fault in the test."""

from __future__ import annotations

import pytest

from tests.gpu.test_gpu import (assert_the_ranks_step_clock_ran, assert_what_the_first_gpu_run_showed_is_gone,
                                lora_through_ftbundle, step_clock_against_the_wall)


@pytest.mark.train
def test_the_gpu_lora_checks_hold_on_the_cpu(tmp_path):
    """The same run and checks on the CPU (gloo, fp32), everywhere: the GPU test's own logic is
    exercised in CI, so a lent GPU's few minutes are not spent finding a fault in the test."""
    proc, log = lora_through_ftbundle(tmp_path, "cpu")
    assert_what_the_first_gpu_run_showed_is_gone(proc, log, "cpu")
    assert_the_ranks_step_clock_ran(tmp_path, 30)


@pytest.mark.train
def test_the_step_clock_against_the_wall_on_the_cpu(tmp_path):
    """The same comparison on the CPU (its clock, no events), everywhere."""
    times, walls = step_clock_against_the_wall(tmp_path, "cpu", 256)
    ratio = sorted(times)[len(times) // 2] / sorted(walls)[len(walls) // 2]
    assert len(times) == 25 and 0.7 < ratio <= 1.05, (times, walls)
