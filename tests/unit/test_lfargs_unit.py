"""ftbundle/lfargs (issue 45, item 1): a LlamaFactory config judged by LlamaFactory's own argument
declarations. The bundled declarations are what the installed LlamaFactory declares (regenerated
here, in a process of its own: importing LlamaFactory takes seconds); values LlamaFactory accepts
are accepted (a 1e-4 that PyYAML reads as a string and OmegaConf as a float, a list where it splits
a string on commas); the refusals are the sweep's (tests/unit/test_bad_input_sweep_unit.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftbundle.lfargs import as_read, judge, schema
from tests.support.helpers import REPO


def test_the_bundled_declarations_are_the_installed_llamafactorys():
    proc = subprocess.run([sys.executable, "-m", "ftbundle.lfargs", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, ("ftbundle/lfargs/declared.py differs from the installed LlamaFactory's declarations: "
                                  "run `python -m ftbundle.lfargs --write`\n" + proc.stderr[-2000:])
    from importlib.metadata import version
    assert schema()["llamafactory"] == version("llamafactory")


def test_what_llamafactory_reads_is_accepted():
    config = {"model_name_or_path": "org/m", "stage": "sft", "do_train": True, "finetuning_type": "lora",
              "lora_target": ["q_proj", "v_proj"], "dataset": "alpaca_en_demo,identity", "template": "llama3",
              "cutoff_len": 1024, "learning_rate": "1e-4", "num_train_epochs": 3, "lr_scheduler_type": "cosine",
              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "bf16": True,
              "deepspeed": "examples/deepspeed/ds_z3_config.json", "report_to": "none", "max_steps": -1,
              "quantization_bit": 4, "quantization_method": "bnb", "output_dir": "saves/x", "save_steps": 500}
    assert judge(config) == []
    assert as_read("1e-4") == 1e-4 and as_read("1.0e-4") == 1e-4 and as_read("fast") == "fast"


@pytest.mark.parametrize("config, key, words", [
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", "at least 1"),
    ({"learning_rate": "fast"}, "learning_rate", "must be a number"),
    ({"bf16": "yes"}, "bf16", "must be true or false"),
    ({"quantization_method": "bitsandbytes"}, "quantization_method", "is not one of"),
    ({"lr_scheduler_type": "cosine_annealing"}, "lr_scheduler_type", "is not one of"),
    ({"finetunig_type": "lora"}, "finetunig_type", "did you mean 'finetuning_type'?"),
    ({"max_steps": 0, "num_train_epochs": 0.0}, "max_steps", "trains zero steps"),
])
def test_each_refusal_names_its_key(config, key, words):
    found = judge({"model_name_or_path": "m", **config})
    assert [f.key for f in found] == [key] and words in found[0].message, found


def test_zero_epochs_with_steps_or_without_training_is_fine():
    assert judge({"max_steps": 10, "num_train_epochs": 0}) == []
    assert judge({"do_train": False, "do_predict": True, "num_train_epochs": 0}) == []


def test_judging_costs_no_import_of_llamafactory():
    """The start stays fast: judging reads the bundled declarations, never LlamaFactory (8 s)."""
    code = ("import sys, time; t = time.perf_counter(); from ftbundle.lfargs import judge; "
            "judge({'model_name_or_path': 'm', 'learning_rate': 1e-4}); "
            "print(time.perf_counter() - t, 'llamafactory' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    seconds, lf, tf = out.split()
    assert lf == "False" and tf == "False", out
    assert float(seconds) < 1.0, out  # (about 2 ms here; a bound, not a benchmark)
