"""One way to publish a file: write it beside its destination, then rename it into place.

A reader (another rank, a resumed run, the user) therefore sees either the old file or the
complete new one, never a half-written one, and a failed write leaves nothing behind.
Used for run outputs, checkpoints and partition caches alike. A write that runs out of disk
space or quota becomes one ``DiskFullError`` naming the file and the bytes it needed; any other
OS error (a read-only directory, a directory where the file should be) becomes one
``OutputError`` naming the path, what was attempted and the OS's reason. :func:`os_errors` is
that mapping, for the few writers and readers of run outputs that do not publish a whole file.
"""
from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from htfl_dist.errors import DiskFullError, HtflError, disk_full_reason, is_disk_full


class OutputError(HtflError):
    """An output (a run directory's files, a partition cache) cannot be written or read back for
    a reason the user can fix: permissions, a read-only file system, a directory where a file
    belongs. One line: what was attempted on which path, and the OS's reason with its errno."""

    def __init__(self, operation: str, exc: OSError, hint: str = "") -> None:
        self.operation, self.errno, self.strerror = operation, exc.errno, exc.strerror or str(exc)
        super().__init__(f"cannot {operation}: {os_reason(exc)}" + (f"; {hint}" if hint else ""))


def os_reason(exc: OSError) -> str:
    """'Is a directory (EISDIR)': the OS's words and the errno's name, for an error line."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno is not None else "no errno"
    return f"{exc.strerror or exc} ({name})"


@contextmanager
def os_errors(operation: str, path: str | os.PathLike, size: int | None = None, hint: str = "") -> Iterator[None]:
    """An ``OSError`` raised inside becomes the one line of its kind: ``DiskFullError`` for a
    full disk or quota (``size``: the bytes being written, when known), else ``OutputError``
    saying ``cannot <operation>`` (the operation names the path), then ``hint`` (how to fix it)."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(path, size, disk_full_reason(exc)) from None
        raise OutputError(operation, exc, hint) from None


@contextmanager
def replaced_atomically(path: str | os.PathLike, size: int | None = None) -> Iterator[str]:
    """Yield a temporary path in ``path``'s directory; when the block succeeds, the file written
    there replaces ``path`` (readable by all, like any shared output); on error it is removed.
    ``size``: the bytes the block writes, when known, for the disk-full line. An OS error in any
    step (the block's included) is one line naming that step (:func:`os_errors`)."""
    destination = Path(path)
    tmp = None
    try:
        with os_errors(f"create the directory {destination.parent}", destination, size):
            destination.parent.mkdir(parents=True, exist_ok=True)
        with os_errors(f"create a file in {destination.parent}", destination, size):
            fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
            os.close(fd)
        with os_errors(f"write {destination}", destination, size):
            yield tmp
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        with os_errors(f"replace {destination}", destination, size):
            os.replace(tmp, destination)
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
