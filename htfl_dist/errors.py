"""User-facing errors.

Anything a user can fix (a config key, a path, a world size) raises ``HtflError``;
``htfl_dist.main`` prints its message as one line and exits with the error's ``exit_status``,
with no traceback. Programming errors stay ordinary exceptions so their tracebacks reach the
developer.
"""
from __future__ import annotations

import errno
import os
import reprlib
from typing import TypeGuard

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1
EXIT_DISK_FULL = 74  # sysexits' EX_IOERR: out of disk space or quota; free space, then --resume auto

SHOWN_CHARS = 200
"""The most characters of a user's value an error line shows: a value can be a megabyte of text
or an aliased YAML structure, and building its full repr can take longer than the run."""

_bounded_repr = reprlib.Repr()
_bounded_repr.maxlevel, _bounded_repr.maxlist, _bounded_repr.maxtuple = 3, 8, 8
_bounded_repr.maxdict, _bounded_repr.maxset = 8, 8
_bounded_repr.maxstring, _bounded_repr.maxlong, _bounded_repr.maxother = SHOWN_CHARS, 60, SHOWN_CHARS


def shown(value: object) -> str:
    """``repr(value)`` for an error line, bounded in length and in the work to build it."""
    text = _bounded_repr.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class HtflError(Exception):
    """A mistake in the user's input: the message says what is wrong and how to fix it."""

    exit_status = EXIT_USER_ERROR
    said_by_rank0 = False
    """Every rank raises it together and rank 0's line says it all: the others print nothing."""


class ConfigError(HtflError):
    """A config key has a value that is not allowed."""


class DataError(HtflError):
    """A dataset path, file or partition request cannot be satisfied."""


class ProtocolError(HtflError):
    """A payload crossing ranks is malformed (wrong shape, dtype, or not finite)."""


class PrivacyPlanError(HtflError):
    """A private client was asked to run a mechanism its privacy plan does not hold (a second
    release in a round, one outside a round, or one past its budget): an algorithm's defect, not
    the user's, so the job ends (status 1) with one line naming the client, the round and the
    mechanism, before any noise is drawn or anything leaves the client."""

    exit_status = EXIT_FAILURE


class DrewWhileConcurrent(HtflError):
    """A client training beside others (``train.concurrent_clients``) drew from torch's global
    RNG, which the clients share, so its draws depended on timing: an algorithm's or a model's
    defect against its declaration, not the user's; the job ends (status 1) with one line naming
    the clients and the round rather than with numbers no other run would give."""

    exit_status = EXIT_FAILURE


class TrainingDiverged(HtflError):
    """Every participating client's loss was not finite for ``train.max_diverged_rounds`` rounds
    in a row: the run cannot recover, so it ends (status 1) with its last good checkpoint."""

    exit_status = EXIT_FAILURE
    said_by_rank0 = True


class NothingAggregated(HtflError):
    """No round of the run aggregated a single upload (every one dropped, late or left out): the
    server never learnt anything, and the accuracies are the clients' own. Not a crash, but not a
    result either, so the run ends (status 1) with one line, after its summary is written."""

    exit_status = EXIT_FAILURE


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""No space, no quota left, or the file-size limit (``ulimit -f``, with SIGXFSZ ignored)."""


class DiskFullError(HtflError):
    """A write ran out of disk space or quota. Not the user's mistake and not a crash: its own
    exit status, so a batch script can tell "free space and resume" from "read the log"."""

    exit_status = EXIT_DISK_FULL

    def __init__(self, path: str | os.PathLike, needed_bytes: int | None, reason: str = "no space left") -> None:
        self.path, self.needed_bytes = str(path), needed_bytes
        needed = f"needed {_size(needed_bytes)}" if needed_bytes is not None else "needed more"
        self.fact = f"disk full ({reason}) writing {self.path}: {needed}, {_free_space(self.path)}"
        super().__init__(self.advising("run again with --resume auto"))

    def advising(self, then: str) -> str:
        """The line with another way to go on than a run's ``--resume auto`` (a study has none: it
        is run again as it was)."""
        return f"{self.fact}; free space (or point --out elsewhere), then {then}"


def is_disk_full(exc: BaseException) -> TypeGuard[OSError]:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def disk_full_reason(exc: OSError) -> str:
    reasons: dict[int | None, str] = {errno.EDQUOT: "quota exceeded", errno.EFBIG: "file size limit"}
    return reasons.get(exc.errno, "no space left")


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit} ({count} bytes)"
    return f"{count} bytes"


def _free_space(path: str) -> str:
    """What the file system holding ``path`` has left, for the line (best effort)."""
    directory = path
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    try:
        stats = os.statvfs(directory or ".")
    except OSError:
        return "free space unknown"
    return f"{_size(stats.f_bavail * stats.f_frsize)} free there"


def clipped(text: str) -> str:
    """Plain text from the user (a key, a path) cut to ``SHOWN_CHARS`` for an error line."""
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class RefusedByRank0(HtflError):
    """Raised on the other ranks when rank 0 refused to start and said why in its own line: they
    end with the same status and print nothing."""

    said_by_rank0 = True
