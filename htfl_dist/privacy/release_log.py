"""Each private client's durable record of what it released, so that a replayed round re-sends
it instead of drawing fresh noise (docs/privacy.md, "Resumed runs").

A checkpoint is written every ``checkpoint_every`` rounds, so the ledger in it can be older than
what left the client: a job killed after a round's upload and before its checkpoint, then
resumed, replays that round from the older state. Fresh noise there would be a second, uncharged
release of the same data. So before an upload leaves, the client's rank writes the release
atomically (``htfl_dist.atomic``: whole or absent, on disk before the rename) to
``<run>/privacy/releases/client_<id>/round_<NNNNN>.pt``, one file per (client, round, mechanism:
the release of class rows), written by whichever rank trains the client and keyed by client id,
like the checkpoints, so a resume on another world size finds it. The file holds exactly the
upload (the class ids and the noised rows, which rank 0 receives anyway): no key, no noise
draw, no training record. A file is removed when the checkpoints are pruned and no kept one is older than its round.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from htfl_dist.atomic import os_errors, publish_bytes

RELEASES_DIR = ("privacy", "releases")
"""Under the run directory: one ``client_<id>`` directory of release files per private client."""

_ROUND_FILE = re.compile(r"round_(\d+)\.pt")


@dataclass(frozen=True)
class Recorded:
    """A release read back: ``rows`` is None where the file is there but cannot be read (it left
    the client, its values are lost)."""

    class_ids: torch.Tensor | None
    rows: torch.Tensor | None


class ReleaseLog:
    """One client's release files in the run directory ``run_dir``."""

    def __init__(self, run_dir: str | Path, client_id: int) -> None:
        self.run_dir = Path(run_dir)
        self.client_id = client_id
        self.directory = self.run_dir.joinpath(*RELEASES_DIR, f"client_{client_id}")

    def path(self, round_index: int) -> Path:
        return self.directory / f"round_{round_index:05d}.pt"

    def recorded(self, round_index: int) -> Recorded | None:
        """The release of 0-based round ``round_index`` if one left this client; None if none did."""
        path = self.path(round_index)
        if not path.is_file():
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            ids, rows = saved["class_ids"], saved["rows"]
            if (saved["client_id"], saved["round"]) != (self.client_id, round_index) or not (
                    isinstance(ids, torch.Tensor) and isinstance(rows, torch.Tensor) and len(ids) == len(rows)):
                raise ValueError("not this client's release of this round")
        except Exception:  # a foreign or damaged file: the release left, its values are lost
            return Recorded(None, None)
        return Recorded(ids.to(torch.int64), rows.to(torch.float32))

    def record(self, round_index: int, class_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Publish the release of ``round_index`` before it leaves (``prune_releases`` drops it
        once no kept checkpoint can replay it)."""
        with os_errors(f"create the privacy release directory {self.directory}", self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save({"client_id": self.client_id, "round": round_index, "mechanism": "release",
                    "class_ids": class_ids.detach().cpu(), "rows": rows.detach().cpu()}, buffer)
        publish_bytes(self.path(round_index), buffer.getbuffer())

def prune_releases(run_dir: Path, before_round: int) -> None:
    """Remove every client's release files of 0-based rounds before ``before_round``: the rounds
    completed by the oldest checkpoint kept, which no resume replays (the checkpoint's pruning
    calls it, where that round is known)."""
    for client_directory in run_dir.joinpath(*RELEASES_DIR).glob("client_*"):
        for path in client_directory.iterdir():
            match = _ROUND_FILE.fullmatch(path.name)
            if match and int(match.group(1)) < before_round:
                path.unlink(missing_ok=True)
