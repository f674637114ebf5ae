"""Atomic, per-client-id checkpoints (DESIGN.md contract 6).

Layout under ``<out>/checkpoints/round_<NNNNN>/``: ``server.pt`` (rank 0), one
``client_<id>.pt`` per logical client (written by whichever rank hosts it), and
``MANIFEST.json`` written by rank 0 *last*, after a barrier, by rename. A round directory
without a manifest is incomplete and ignored, so a job killed mid-save never damages the
previous checkpoint. Nothing is keyed by rank, so a job may resume on a different world size.

No RNG state is stored: every stream is derived from (seed, client id, round), so the
round number is all a resumed run needs to draw the same numbers.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from htfl_dist.errors import HtflError
from htfl_dist.metrics.writer import write_json

KEEP_LATEST = 2


def _round_dir(out_dir: Path, completed_rounds: int) -> Path:
    return out_dir / "checkpoints" / f"round_{completed_rounds:05d}"


def _save_atomic(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(out_dir: Path, completed_rounds: int, config_hash: str, transport, *, clients, server,
         expected_clients: list[int]) -> None:
    directory = _round_dir(out_dir, completed_rounds)
    directory.mkdir(parents=True, exist_ok=True)
    for client_id, client in clients.items():
        state = {
            "client_id": client_id,
            "architecture": client.architecture,
            "model": client.model.state_dict(),
            "optimizer": client.optimizer.state_dict(),
        }
        _save_atomic(state, directory / f"client_{client_id}.pt")
    if server is not None:
        _save_atomic({"server": server.state_dict()}, directory / "server.pt")
    transport.barrier()
    if transport.rank == 0:
        missing = [cid for cid in expected_clients if not (directory / f"client_{cid}.pt").exists()]
        if missing:
            raise HtflError(f"checkpoint of round {completed_rounds} lacks clients {missing[:5]}; "
                            f"is {out_dir} on a file system every node shares?")
        write_json(directory / "MANIFEST.json", {
            "round": completed_rounds, "config_hash": config_hash,
            "clients": expected_clients, "files": sorted(p.name for p in directory.glob("*.pt")),
        })
        _prune(out_dir)
    transport.barrier()


def _complete_rounds(out_dir: Path) -> list[tuple[int, Path]]:
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for directory in root.glob("round_*"):
        if (directory / "MANIFEST.json").is_file():
            found.append((int(directory.name.split("_")[1]), directory))
    return sorted(found)


def _prune(out_dir: Path) -> None:
    for _, directory in _complete_rounds(out_dir)[:-KEEP_LATEST]:
        shutil.rmtree(directory, ignore_errors=True)


def _load(path: Path, device: torch.device):
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise HtflError(f"checkpoint file {path} is missing; delete {path.parent} to resume from an earlier one") from None
    except Exception as exc:  # corrupt archive, truncated file, foreign pickle
        raise HtflError(f"checkpoint file {path} cannot be read ({type(exc).__name__}); "
                        f"delete {path.parent} to resume from an earlier one") from None


def load_latest(out_dir: Path, config_hash: str, *, clients, server, device: torch.device) -> int | None:
    """Restore the newest complete checkpoint; returns its completed-round count, or None."""
    complete = _complete_rounds(out_dir)
    if not complete:
        return None
    completed_rounds, directory = complete[-1]
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    if manifest["config_hash"] != config_hash:
        raise HtflError(
            f"checkpoint in {directory} was made with config hash {manifest['config_hash']}, this run has "
            f"{config_hash}; resume with the same config or use a new --out directory"
        )
    for client_id, client in clients.items():
        state = _load(directory / f"client_{client_id}.pt", device)
        if state["architecture"] != client.architecture:
            raise HtflError(f"checkpoint client {client_id} is a {state['architecture']}, config says "
                            f"{client.architecture}")
        client.model.load_state_dict(state["model"])
        client.optimizer.load_state_dict(state["optimizer"])
    if server is not None:
        server.load_state_dict(_load(directory / "server.pt", torch.device("cpu"))["server"])
    return completed_rounds
