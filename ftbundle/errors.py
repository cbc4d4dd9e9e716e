"""The one error type for user mistakes.

Anything the user can fix by editing a file or a flag raises :class:`UserError`; the CLI
maps it to exit code 2 and a one-paragraph message. Every other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import difflib
import reprlib
from typing import Any, Iterable

EXIT_USAGE = 2
# No message is longer than a screen: a value is shown cut (see show()), and a message
# that is still longer is cut at this many characters.
MAX_MESSAGE = 2000
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple, _SHORT.maxset = 2, 4, 4, 4, 4
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 120, 120, 40


def show(value: Any) -> str:
    """``repr(value)`` cut to a line: a YAML alias can make a value of a billion items whose
    whole repr would fill the terminal (or the memory) for one message."""
    return _SHORT.repr(value)


class UserError(Exception):
    """A mistake in the job file, the inventory or the command line.

    ``file`` and ``key`` say where; ``message`` says what is wrong and what would be valid.
    """

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(str(self.file))
        if self.key:
            where.append(f"key '{self.key}'")
        prefix = ": ".join(where)
        text = f"{prefix}: {self.message}" if prefix else self.message
        if len(text) > MAX_MESSAGE:
            text = f"{text[:MAX_MESSAGE]} ... ({len(text) - MAX_MESSAGE:,} more characters cut)"
        return text


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' when a close match exists, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
