"""One way to publish a file: write it beside its destination, then rename it into place.

A reader (another rank, a resumed run, the user) therefore sees either the old file or the
complete new one, never a half-written one, and a failed write leaves nothing behind.
Used for run outputs, checkpoints and partition caches alike.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path in ``path``'s directory; when the block succeeds, the file written
    there replaces ``path`` (readable by all, like any shared output); on error it is removed."""
    destination = Path(path)
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, destination)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
