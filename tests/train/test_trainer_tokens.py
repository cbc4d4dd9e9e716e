"""A script that trains with the HF Trainer gets tokens/s and MFU from its step-times callback
(shims/steptimes.py StepTimes) when it turns on the trainer's own count
(``include_num_input_tokens_seen``): a real Trainer on the tiny Llama, on the CPU. The line the
callback writes carries each step's tokens (this rank's share of the trainer's gathered count)
and the model's parameters, and agrees with a count of the batches by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import helpers

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return helpers.tiny_model()


def train(tmp_path: Path, tiny_model: Path, tokens_seen, callback_tokens: bool = True) -> tuple[list[str], int]:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from ftbundle.shims.steptimes import StepClock, StepTimes

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    # 24 rows of 16 tokens, the last 4 of each padding (attention mask 0)
    mask = torch.ones(16, dtype=torch.long)
    mask[12:] = 0
    rows = [{"input_ids": ids, "labels": ids, "attention_mask": mask}
            for ids in torch.randint(4, 512, (24, 16), generator=torch.Generator().manual_seed(0))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, logging_steps=1, use_cpu=True,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, report_to="none",
                             save_strategy="no", disable_tqdm=True, include_num_input_tokens_seen=tokens_seen)
    clock = StepClock(str(tmp_path / "a1.steps"), "0")
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepTimes(clock, tokens=callback_tokens)]).train()
    params = sum(p.numel() for p in model.parameters())
    return (tmp_path / "a1.steps.0").read_text().split(), params


def test_the_trainers_own_token_count_reaches_the_step_times_line(tmp_path, tiny_model):
    line, params = train(tmp_path, tiny_model, "non_padding")
    # 6 steps of 2 micro-batches of 2 rows, 12 tokens each without padding: 48 a step; the first
    # step starts the clock, the other 5 are counted
    assert len(line) == 7, line
    assert (line[1], int(line[4]), int(line[6])) == ("6", 5 * 48, params), line
    assert float(line[5]) > 0
    # every token, padding included: 64 a step
    every, _ = train(tmp_path / "all", tiny_model, "all")
    assert int(every[4]) == 5 * 64, every
    # no count turned on, or the callback told not to (LlamaFactory's entry): the line as before
    off, _ = train(tmp_path / "off", tiny_model, False)
    told, _ = train(tmp_path / "told", tiny_model, "all", callback_tokens=False)
    assert len(off) == 4 and len(told) == 4, (off, told)
