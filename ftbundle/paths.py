"""Path questions every layer asks (no imports beyond posixpath)."""

from __future__ import annotations

import posixpath


def is_under(path: str, parent: str) -> bool:
    """Whether ``path`` is ``parent`` or inside it, by name (both normalized; nothing is read)."""
    path, parent = posixpath.normpath(path), posixpath.normpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")
