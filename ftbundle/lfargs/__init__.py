"""A LlamaFactory config judged as LlamaFactory will read it, before anything starts (issue 45, item 1).

LlamaFactory reads its YAML with OmegaConf and hands the mapping to transformers'
``HfArgumentParser.parse_dict`` over its five argument dataclasses (``_TRAIN_ARGS``): a key that
none of them declares stops every rank ("Some keys are not used by the HfArgumentParser"), and a
value of the wrong type (``learning_rate: fast``, ``gradient_accumulation_steps: 2.5``) is not
converted: it fails later, in the trainer, after every host has started and loaded its model.

The declarations are LlamaFactory's own, never copied by hand: ``declared.py`` beside this file
(JSON in a string: a .py file ships with the package like the others) is written by ``python -m ftbundle.lfargs --write`` from the installed LlamaFactory's dataclasses
(each field's type, whether it may be null, its choices from a ``Literal`` or an ``Enum``; the
chat templates it registers), with the version it came from. Importing LlamaFactory takes
seconds (transformers, torch); reading the JSON takes a millisecond, so every start judges the
config at no cost. tests/unit/test_lfargs_unit.py regenerates it from the LlamaFactory the
project installs and fails when it differs.

What the declarations do not say and the trainer needs (a batch of at least 1, a run that
trains at least one step) are the few ranges in :data:`AT_LEAST`.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).with_name("declared.py")

# What the trainer needs of a value that its type allows (HF/LlamaFactory fail on it later:
# a ZeroDivisionError for 0 accumulation steps, an empty batch, no token of context).
AT_LEAST = {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1,
            "cutoff_len": 1, "learning_rate": 0, "num_train_epochs": 0, "save_steps": 0, "logging_steps": 0,
            "warmup_steps": 0, "lora_rank": 1, "lora_alpha": 1, "lora_dropout": 0, "weight_decay": 0}

# A number as OmegaConf's YAML loader reads it (1e-4 is a string to PyYAML, a float to LlamaFactory)
_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|"
                    r"\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$")


@dataclass(frozen=True)
class Finding:
    key: str
    message: str


@functools.cache
def schema() -> dict:
    from .declared import JSON

    return json.loads(JSON)


def as_read(value: Any) -> Any:
    """A value as LlamaFactory sees it once OmegaConf has read the staged YAML."""
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        try:
            return float(value.replace("_", ""))
        except ValueError:
            return value
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _said(kinds: list[str]) -> str:
    names = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
             "dict": "a mapping", "list": "a list", "null": "null"}
    return " or ".join(names.get(k, k) for k in kinds)


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def judge(config: dict[str, Any], *, skip: frozenset[str] = frozenset()) -> list[Finding]:
    """Every key of ``config`` that LlamaFactory would refuse or fail on, in the config's order.
    ``skip``: keys that ftbundle itself handles before the ranks read the config."""
    s = schema()
    fields, version = s["fields"], s["llamafactory"]
    found: list[Finding] = []
    for key, raw in config.items():
        if key in skip:
            continue
        spec = fields.get(key)
        if spec is None:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.8)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            found.append(Finding(key, f"is not an argument of LlamaFactory {version}: it stops every rank with "
                                      f"\"Some keys are not used by the HfArgumentParser\"{hint}"))
            continue
        value = as_read(raw)
        kinds = spec["kinds"]
        kind = _kind(value)
        ok = kind in kinds or (kind == "int" and "float" in kinds) or (
            # a str LlamaFactory splits on commas also takes a list (split_arg); a number is kept as it is
            "str" in kinds and kind in ("list", "int", "float") and not spec.get("choices"))
        if not ok:
            found.append(Finding(key, f"must be {_said(kinds)} ({spec['owner']}); got {_show(raw)}"))
            continue
        choices = spec.get("choices")
        if choices and isinstance(value, str) and value not in choices:
            near = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            listed = ", ".join(choices) if len(choices) <= 12 else ", ".join(choices[:12]) + f", ... ({len(choices)})"
            found.append(Finding(key, f"{_show(raw)} is not one of LlamaFactory {version}'s: {listed}{hint}"))
            continue
        low = AT_LEAST.get(key)
        if low is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value < low:
            found.append(Finding(key, f"must be at least {low}; got {_show(raw)}"))
    template = config.get("template")
    if "template" not in skip and isinstance(template, str) and s.get("templates") and template not in s["templates"]:
        near = difflib.get_close_matches(template, s["templates"], n=1, cutoff=0.6)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        found.append(Finding("template", f"{_show(template)} is not a chat template of LlamaFactory {version} "
                                         f"({len(s['templates'])} are registered){hint}"))
    found += _zero_steps(config)
    return found


def _zero_steps(config: dict[str, Any]) -> list[Finding]:
    """max_steps wins when it is above 0; otherwise num_train_epochs counts: neither above 0
    trains nothing (HF's trainer runs 0 steps, exits 0 and writes an untrained adapter)."""
    steps = as_read(config.get("max_steps", -1))
    epochs = as_read(config.get("num_train_epochs", 3.0))
    if config.get("do_train") is False:
        return []
    if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps <= 0 \
            and isinstance(epochs, (int, float)) and not isinstance(epochs, bool) and epochs <= 0:
        return [Finding("max_steps", f"max_steps: {config.get('max_steps', -1)} with num_train_epochs: "
                                     f"{config.get('num_train_epochs', 3.0)} trains zero steps (the run would "
                                     "finish at once with an untrained model): set max_steps above 0 or "
                                     "num_train_epochs above 0")]
    return []
