"""Atomic, per-client-id checkpoints (docs/architecture.md).

Layout under ``<out>/checkpoints/round_<NNNNN>/``: ``server.pt`` (rank 0), one
``client_<id>.pt`` per logical client (written by whichever rank hosts it), and
``MANIFEST.json`` written by rank 0 *last*, after a barrier, by rename; every file and name is
fsynced before the manifest vouches for it and before older checkpoints are pruned. A round directory
without a manifest is incomplete and ignored, so a job killed mid-save never damages the
previous checkpoint. A save that runs out of disk space removes its round directory and ends the
run with one line (``DiskFullError``); the previous checkpoint stays whole and resumable. The
manifest also lists the rounds whose metrics rows exist, so a resume can tell a metrics file that
lost rows, and the sha256 of the ``model.pretrained`` files the clients started from. Nothing is
keyed by rank, so a job may resume on a different world size.

No RNG state is stored: every stream is derived from (seed, client id, round), so the
round number is all a resumed run needs to draw the same numbers.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from htfl_dist.algorithms import ServerAlgorithm, spelled_out_options
from htfl_dist.atomic import OutputError, os_errors, publish_bytes
from htfl_dist.config import Config, experiment_differences, experiment_view
from htfl_dist.config.identity import stored_options
from htfl_dist.errors import DiskFullError, HtflError
from htfl_dist.metrics.writer import write_json
from htfl_dist.models import pretrained_change, pretrained_identity
from htfl_dist.privacy.release_log import prune_releases
from htfl_dist.runtime.client_store import ClientStore
from htfl_dist.runtime.transport import Transport

_ROUND_DIR = re.compile(r"round_(\d+)")
CHECKPOINT_DIR = "checkpoints"
"""In the run directory: one ``round_NNNNN`` directory per kept checkpoint."""


def _round_dir(out_dir: Path, completed_rounds: int) -> Path:
    return out_dir / CHECKPOINT_DIR / f"round_{completed_rounds:05d}"


def _save_atomic(obj, path: Path) -> None:
    """Write ``obj`` to ``path`` by rename, with its bytes on disk first: the manifest that
    vouches for this file is fsynced and older checkpoints are pruned after it, so an unsynced
    file could leave, after a node crash, a "complete" checkpoint of empty .pt files as the only one.
    Serialised in memory first: a full disk then fails in our write, naming the file and its size,
    not deep inside torch's archive writer."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    publish_bytes(path, buffer.getbuffer())


def _fsync_directory(directory: Path) -> None:
    """Make the renames into ``directory`` durable (fsyncing a file does not persist its name).
    Skipped where directories cannot be opened or synced (non-POSIX systems, some file systems)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            with os_errors(f"sync the directory {directory}", directory):
                raise
    finally:
        os.close(fd)


def save(out_dir: Path, completed_rounds: int, config: Config, transport: Transport, *,
         clients: ClientStore, server: ServerAlgorithm | None, metric_rounds: list[int] | None = None,
         data_identity: str = "", runtime_state: dict | None = None) -> None:
    """Every rank writes the clients it hosts (and rank 0 the server); rank 0 publishes the
    manifest after a barrier, then prunes all but the newest ``config.checkpoint_keep``.
    ``metric_rounds``: the rounds whose metrics rows rank 0 has written so far; ``data_identity``:
    what the clients trained on (``PartitionInfo.identity``), checked by a resume;
    ``runtime_state``: rank 0's own state across rounds (the simulated clock), beside the server's."""
    expected_clients = list(range(config.num_clients))
    directory = _round_dir(out_dir, completed_rounds)
    try:
        _save_own_files(directory, clients, server, runtime_state)
    except (DiskFullError, OutputError):
        shutil.rmtree(directory, ignore_errors=True)  # never a partial round_NNNNN/ beside the good one
        raise
    transport.barrier()
    transport.barrier()
    if transport.rank == 0:
        missing = [cid for cid in expected_clients if not (directory / f"client_{cid}.pt").exists()]
        if missing:
            raise HtflError(f"checkpoint of round {completed_rounds} lacks clients {missing[:5]}; "
                            f"is {out_dir} on a file system every node shares?")
        write_json(directory / "MANIFEST.json", {
            "round": completed_rounds, "config_hash": config.config_hash(), "experiment": config.experiment(),
            "clients": expected_clients, "files": sorted(p.name for p in directory.glob("*.pt")),
            "metric_rounds": list(metric_rounds or []), "data": data_identity,
            **({"pretrained": pretrained_identity(config)} if config.model.pretrained else {}),
        })
        # the manifest's name and the round directory's, durable before older checkpoints are deleted
        for synced in (directory, directory.parent):
            _fsync_directory(synced)
        _prune(out_dir, config.checkpoint_keep)
    transport.barrier()


def _save_own_files(directory: Path, clients: ClientStore, server: ServerAlgorithm | None,
                    runtime_state: dict | None = None) -> None:
    with os_errors(f"create the checkpoint directory {directory}", directory):
        directory.mkdir(parents=True, exist_ok=True)
    for client_id in clients:  # parked clients' records come from the store, one at a time
        _save_atomic(clients.record(client_id), directory / f"client_{client_id}.pt")
    if server is not None:
        _save_atomic({"server": server.state_dict(), "runtime": runtime_state or {}}, directory / "server.pt")
    _fsync_directory(directory)  # each rank its own renames, before the manifest vouches for them


def metric_rounds(directory: Path, eval_every: int) -> list[int]:
    """The rounds whose metrics rows the checkpoint in ``directory`` vouches for: as its manifest
    lists them, or (a manifest written before they were listed) every ``eval_every``-th round."""
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    listed = manifest.get("metric_rounds")
    if isinstance(listed, list) and all(isinstance(number, int) for number in listed):
        return listed
    return [number for number in range(1, int(manifest["round"]) + 1) if number % eval_every == 0]


def _checkpoint_dirs(out_dir: Path) -> list[tuple[int, Path]]:
    """(round, directory) of every ``round_<digits>`` directory; anything else a user or a tool
    left there (``round_00003.bak``, ``round_old``) is not ours and is ignored, never deleted."""
    root = out_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for directory in root.iterdir():
        match = _ROUND_DIR.fullmatch(directory.name)
        if match and directory.is_dir():
            found.append((int(match.group(1)), directory))
    return sorted(found)


def _complete_rounds(out_dir: Path) -> list[tuple[int, Path]]:
    return [(number, d) for number, d in _checkpoint_dirs(out_dir) if (d / "MANIFEST.json").is_file()]


def _prune(out_dir: Path, keep: int) -> None:
    """Drop all but the newest ``keep`` complete checkpoints, and any incomplete one (a save cut
    short by a crash) older than the newest complete checkpoint."""
    complete = _complete_rounds(out_dir)
    for _, directory in complete[:-keep]:
        shutil.rmtree(directory, ignore_errors=True)
    if not complete:
        return
    prune_releases(out_dir, complete[-keep:][0][0])  # private runs: releases no kept checkpoint replays
    newest = complete[-1][0]
    for number, directory in _checkpoint_dirs(out_dir):
        if not (directory / "MANIFEST.json").is_file() and number < newest:
            shutil.rmtree(directory, ignore_errors=True)


def _load(path: Path, device: torch.device):
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise HtflError(f"checkpoint file {path} is missing; "
                        f"delete {path.parent} to resume from an earlier one") from None
    except Exception as exc:  # corrupt archive, truncated file, foreign pickle
        raise HtflError(f"checkpoint file {path} cannot be read ({type(exc).__name__}); "
                        f"delete {path.parent} to resume from an earlier one") from None


def _changes_since(manifest: dict, config: Config) -> list[str]:
    """What differs between the checkpoint's experiment and this run's, with a manifest written by
    an older version brought to today's form first (data paths were part of the experiment, and
    ``algo`` was kept as typed rather than with every option spelled out), so such checkpoints
    still resume; an option the view left out at its value before a default changed is read as
    that value, not today's default (``stored_options``). An empty list means the same experiment."""
    saved = experiment_view(manifest.get("experiment", {}), Config)
    with contextlib.suppress(HtflError):  # an algorithm or option this version lacks: the comparison names it
        algorithm = saved.get("algorithm", config.algorithm)
        spelled = spelled_out_options(algorithm, stored_options(algorithm, saved.get("algo") or {}))
        saved = experiment_view({**saved, "algo": spelled}, Config)
    return experiment_differences(saved, config.experiment())


def data_change(manifest: dict, data_identity: str) -> str:
    """'SAVED -> NOW' when the checkpoint's clients trained on other data than ``data_identity``;
    '' when they match or either side is unknown."""
    saved = manifest.get("data")
    if not isinstance(saved, str) or not saved or not data_identity or saved == data_identity:
        return ""
    return f"{saved} -> {data_identity}"


def find_checkpoint(source: Path) -> Path | None:
    """``source`` is a run directory (newest complete checkpoint in it) or one checkpoint
    directory holding a MANIFEST.json."""
    if (source / "MANIFEST.json").is_file():
        return source
    complete = _complete_rounds(source)
    return complete[-1][1] if complete else None


def load(directory: Path, config: Config, *, clients: ClientStore, server: ServerAlgorithm | None,
         device: torch.device, data_identity: str = "",
         restore_runtime: Callable[[dict], None] | None = None) -> tuple[int, str]:
    """Restore the checkpoint in ``directory``; returns its completed-round count and the data
    change ('' for none, see ``data_change``). A checkpoint whose clients trained on other data than
    ``data_identity`` is refused unless ``data.allow_changed`` (a manifest written before the data
    were recorded is not checked), and so is one whose clients started from other
    ``model.pretrained`` files (their sha256, in the manifest). ``restore_runtime`` receives rank
    0's runtime state ({} from a checkpoint written before there was any)."""
    try:
        manifest = json.loads((directory / "MANIFEST.json").read_text())
        completed_rounds = int(manifest["round"])  # a list or a string here is a foreign file
    except (OSError, ValueError, KeyError, TypeError):
        raise HtflError(f"checkpoint manifest {directory / 'MANIFEST.json'} is unreadable; "
                        f"delete {directory} to resume from an earlier one") from None
    changes = [] if manifest.get("config_hash") == config.config_hash() else _changes_since(manifest, config)
    if changes:
        raise HtflError(
            f"checkpoint {directory} belongs to another experiment "
            f"({'; '.join(changes[:4])}); "
            f"resume with the same config or use a new --out directory"
        )
    changed = data_change(manifest, data_identity)
    if changed and not config.data.allow_changed:
        raise HtflError(f"checkpoint {directory} was trained on other data ({changed}): the source files or the "
                        f"split changed; resume on the data it trained on, or set data.allow_changed=true to go on "
                        f"with these on purpose (summary.json records it)")
    weights = pretrained_change(manifest.get("pretrained"), config)
    if weights:
        raise HtflError(f"checkpoint {directory} started from other pre-trained weights ({weights}); resume with "
                        f"the model.pretrained files it started from, or use a new --out directory")
    for client_id in clients:
        clients.restore(client_id, _load(directory / f"client_{client_id}.pt", device), f"checkpoint {directory}")
    if server is not None:
        saved = _load(directory / "server.pt", torch.device("cpu"))
        server.load_state_dict(saved["server"])
        if restore_runtime is not None:
            restore_runtime(saved.get("runtime", {}))
    return completed_rounds, changed
