"""``python -m ftbundle.lfargs --write``: declared.py from the installed LlamaFactory's own
argument dataclasses (``--check``: exit 1 when the file differs from them)."""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import types
import typing

from . import SCHEMA


def _kinds(tp) -> tuple[list[str], list[str] | None]:
    """(the YAML kinds a declared type accepts, its choices or None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        kinds, choices = [], None
        for arg in typing.get_args(tp):
            k, c = _kinds(arg)
            kinds += [x for x in k if x not in kinds]
            if c is not None:
                choices = (choices or []) + [x for x in c if x not in (choices or [])]
        if choices is not None and set(kinds) <= {"str", "null"}:
            return kinds, choices  # an Enum or Literal with `| str`: transformers turns the str into the Enum
        return kinds, None if "str" in kinds and choices is None else choices
    if origin is typing.Literal:
        values = list(typing.get_args(tp))
        return sorted({type(v).__name__ for v in values}), [str(v) for v in values]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ["str"], [str(m.value) for m in tp]
    if tp is type(None):
        return ["null"], None
    if origin in (list, tuple) or tp in (list, tuple):
        return ["list"], None
    if origin is dict or tp is dict:
        return ["dict"], None
    if tp is bool:
        return ["bool"], None
    if tp is int:
        return ["int"], None
    if tp is float:
        return ["float"], None
    if tp is str:
        return ["str"], None
    return ["bool", "int", "float", "str", "dict", "list", "null"], None  # (anything else: not judged)


def generate() -> dict:
    from importlib.metadata import version

    from llamafactory.data.template import TEMPLATES
    from llamafactory.hparams.parser import _TRAIN_ARGS

    fields = {}
    for cls in _TRAIN_ARGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or f.name in fields:
                continue
            kinds, choices = _kinds(hints.get(f.name, f.type))
            default = f.default if f.default is not dataclasses.MISSING else None
            if default is None and "null" not in kinds and f.default is not dataclasses.MISSING:
                kinds.append("null")
            entry = {"kinds": kinds, "owner": cls.__name__}
            if choices:
                entry["choices"] = choices
            fields[f.name] = entry
    return {"llamafactory": version("llamafactory"), "transformers": version("transformers"),
            "fields": dict(sorted(fields.items())), "templates": sorted(TEMPLATES)}


def render(data: dict) -> str:
    """declared.py's text: the JSON in a string, with where it came from."""
    return ('"""LlamaFactory\'s argument declarations, as ftbundle/lfargs judges a config by them. Written by\n'
            '`python -m ftbundle.lfargs --write` from the installed LlamaFactory; never edit by hand."""\n\n'
            f"JSON = r\'\'\'{compact(data)}\'\'\'\n")


def compact(data: dict) -> str:
    """One line per field (a diff of two LlamaFactory versions reads field by field)."""
    head = {k: v for k, v in data.items() if k not in ("fields", "templates")}
    lines = ["{" + json.dumps(head)[1:-1] + ","]
    lines.append('"templates": ' + json.dumps(data["templates"]) + ",")
    lines.append('"fields": {')
    items = list(data["fields"].items())
    lines += [f"{json.dumps(k)}: {json.dumps(v)}" + ("," if i < len(items) - 1 else "") for i, (k, v) in enumerate(items)]
    lines.append("}}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render(generate())
    if "--write" in argv:
        SCHEMA.write_text(text)
        return 0
    if "--check" in argv:
        return 0 if SCHEMA.read_text() == text else 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
