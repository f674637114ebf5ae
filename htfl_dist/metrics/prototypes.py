"""Prototype snapshots: what rank 0 received and sent, kept for pictures.

With ``output.prototypes_every=N``, every N-th round rank 0 writes
``RUN/prototypes/round_NNNNN.pt``: the round's uploaded class prototypes (after screening, in
client-id order) and the global class vectors it sends down after its update (``protos``, and
FedSA's ``anchors``). The metrics rows cannot hold these (C·K floats per round), and the
checkpoints hold models, not the vectors the algorithm exchanged. A file holds tensors only and is
read back with ``torch.load(weights_only=True)``; each is written atomically, and a resumed run
rewrites the rounds after its checkpoint.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from htfl_dist.atomic import replaced_atomically
from htfl_dist.errors import ConfigError
from htfl_dist.payload import Payload, PayloadSpec

SNAPSHOT_DIR = "prototypes"
GLOBAL_FIELDS = ("protos", "anchors")
"""Download fields drawn as global class vectors (one row per class id of the download)."""
_FILE = re.compile(r"round_(\d{5,})\.pt")

Snapshot = dict[str, torch.Tensor]


def _field_names(spec: PayloadSpec) -> set[str]:
    return {field.name for field in spec}


def check_prototype_payloads(algorithm: str, upload_spec: PayloadSpec, download_spec: PayloadSpec) -> None:
    """``output.prototypes_every`` needs class-indexed prototypes on the wire; say so up front
    (exit 2) rather than write empty files for a whole run."""
    uploads = {"class_ids", "protos"} <= _field_names(upload_spec)
    downloads = "class_ids" in _field_names(download_spec) and bool(_field_names(download_spec) & set(GLOBAL_FIELDS))
    if not (uploads or downloads):
        raise ConfigError(f"output.prototypes_every needs an algorithm that sends class prototypes; "
                          f"'{algorithm}' sends none (set output.prototypes_every=0)")


def snapshot(uploads: dict[int, Payload], download: Payload) -> Snapshot:
    """One round's vectors as flat tensors: ``upload_client_ids``, ``upload_class_ids``,
    ``upload_protos`` (one row per uploaded prototype), and ``global_class_ids`` with one
    ``global_<field>`` table per download field in :data:`GLOBAL_FIELDS` that the download has."""
    rows = [(cid, upload) for cid, upload in sorted(uploads.items()) if "protos" in upload]
    result: Snapshot = {}
    if rows:
        result["upload_client_ids"] = torch.cat([torch.full((u["class_ids"].numel(),), cid, dtype=torch.int64)
                                                 for cid, u in rows])
        result["upload_class_ids"] = torch.cat([u["class_ids"].to(torch.int64).cpu() for _, u in rows])
        result["upload_protos"] = torch.cat([u["protos"].float().cpu() for _, u in rows])
    if "class_ids" in download:
        result["global_class_ids"] = download["class_ids"].to(torch.int64).cpu()
        for name in GLOBAL_FIELDS:
            if name in download:
                result[f"global_{name}"] = download[name].float().cpu()
    return result


class PrototypeSnapshots:
    """Rank 0's writer of ``prototypes/round_NNNNN.pt`` every ``every`` rounds."""

    def __init__(self, out_dir: Path, every: int) -> None:
        self.directory = Path(out_dir) / SNAPSHOT_DIR
        self.every = every

    def due(self, round_number: int) -> bool:
        return self.every > 0 and round_number % self.every == 0

    def save(self, round_number: int, uploads: dict[int, Payload], download: Payload) -> None:
        with replaced_atomically(self.directory / f"round_{round_number:05d}.pt") as tmp:
            torch.save(snapshot(uploads, download), tmp)


def snapshot_rounds(run_dir: str | Path) -> list[int]:
    """The rounds with a snapshot in ``run_dir``, ascending (half-written temporaries ignored)."""
    directory = Path(run_dir) / SNAPSHOT_DIR
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _FILE.fullmatch(p.name)))


def load_snapshot(run_dir: str | Path, round_number: int) -> Snapshot:
    """One round's snapshot, tensors only (no pickled objects are accepted)."""
    path = Path(run_dir) / SNAPSHOT_DIR / f"round_{round_number:05d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)
