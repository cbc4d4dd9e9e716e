"""The one error type for user mistakes.

Anything the user can fix by editing a file or a flag raises :class:`UserError`; the CLI
maps it to exit code 2 and a one-paragraph message. Every other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import difflib
from typing import Iterable

EXIT_USAGE = 2


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
        return f"{prefix}: {self.message}" if prefix else self.message


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' when a close match exists, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
