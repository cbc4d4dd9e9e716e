"""Reading the files a user names (job, LlamaFactory config, DeepSpeed JSON, inventory)
so that no input can hang, exhaust memory or end in a traceback.

Every such file is checked before a byte is read: it must resolve (a symlink loop is named
as one), be a regular file (a FIFO would block the reader forever, a device such as
/dev/zero would never end, a directory is not a file), be at most ``MAX_BYTES`` long, and
decode as UTF-8 (the byte and line of the first bad byte are named). YAML is parsed with
duplicate keys refused: a repeated key silently won by its last value is a mistake that
YAML itself accepts.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError

# A job file, a LlamaFactory config or a DeepSpeed config is a page or two of text; an
# inventory of thousands of hosts stays well under this.
MAX_BYTES = 1 << 20

_KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


def resolve(path: str | Path, what: str, key: str | None = None, file: str | None = None) -> Path:
    """The path made absolute with its symlinks followed; a loop is a UserError."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # Python 3.11 raises RuntimeError for a symlink loop
        raise UserError(f"{what} {path} is a symbolic link loop (it never reaches a file)",
                        file=file or str(path), key=key) from None


def check_regular(path: Path, what: str, key: str | None = None, file: str | None = None,
                  limit: int = MAX_BYTES) -> int:
    """Raise unless ``path`` is a readable regular file of at most ``limit`` bytes; its size."""
    where = file or str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}", file=where, key=key) from None
    except OSError as exc:
        if exc.errno == 40:  # ELOOP
            raise UserError(f"{what} {path} is a symbolic link loop (it never reaches a file)",
                            file=where, key=key) from None
        raise UserError(f"cannot read {what} {path}: {exc.strerror}", file=where, key=key) from None
    for test, kind in _KINDS.items():
        if test(st.st_mode):
            raise UserError(f"{what} {path} is {kind}, not a file", file=where, key=key)
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} {path} is not a regular file", file=where, key=key)
    if st.st_size > limit:
        raise UserError(f"{what} {path} is {st.st_size:,} bytes; at most {limit:,} are read "
                        "(is it the file you meant?)", file=where, key=key)
    return st.st_size


def read_text(path: str | Path, what: str, key: str | None = None, file: str | None = None,
              limit: int = MAX_BYTES) -> str:
    """The file's text, after :func:`check_regular`; not UTF-8 is a UserError naming where."""
    path = resolve(path, what, key, file)
    check_regular(path, what, key, file, limit)
    where = file or str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror}", file=where, key=key) from None
    if len(data) > limit:  # grew since the stat
        raise UserError(f"{what} {path} is over {limit:,} bytes", file=where, key=key)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"{what} is not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} "
                        f"(offset {exc.start}); save it as UTF-8",
                        file=f"{path}:{line}" if file is None else where, key=key) from None


# libyaml's parser where PyYAML has it (the pure-Python one takes about 10 s a megabyte)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: SafeLoader's own error follows
            break
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice (first on line {first}); YAML would keep only the last",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return _SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, path: Path | str) -> Any:
    """Parse YAML, refusing duplicate keys; a syntax error names file:line:column."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"malformed YAML: {problem}", file=where) from None
