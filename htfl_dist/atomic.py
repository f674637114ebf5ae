"""One way to publish a file: write it beside its destination, then rename it into place.

A reader (another rank, a resumed run, the user) therefore sees either the old file or the
complete new one, never a half-written one, and a failed write leaves nothing behind.
Used for run outputs, checkpoints and partition caches alike. A write that runs out of disk
space or quota becomes one ``DiskFullError`` naming the file and the bytes it needed.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from htfl_dist.errors import DiskFullError, disk_full_reason, is_disk_full


@contextmanager
def replaced_atomically(path: str | os.PathLike, size: int | None = None) -> Iterator[str]:
    """Yield a temporary path in ``path``'s directory; when the block succeeds, the file written
    there replaces ``path`` (readable by all, like any shared output); on error it is removed.
    ``size``: the bytes the block writes, when known, for the disk-full line."""
    destination = Path(path)
    tmp = None
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
        os.close(fd)
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, destination)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(destination, size, disk_full_reason(exc)) from None
        raise
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def publish_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Publish ``data`` at ``path`` all at once, its bytes on disk before the rename (a manifest
    or a later prune may rely on the file surviving a node crash)."""
    with replaced_atomically(path, len(data)) as tmp, open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
