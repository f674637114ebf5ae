"""Pictures of the images a server sends down (FedKTL's C generated class images).

Rank 0 writes ``RUN/generated/round_NNNNN.png`` on every evaluated round whose images differ from
the last ones written (and so always on the last round): one tile per class, in class order, at
the clients' resolution (enlarged, nearest-neighbour, to at least 56 px). Whether the C images
are distinct, and whether they still look like the generator's images or have drifted into
noise, is the first thing to check when FedKTL does not help.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from htfl_dist.atomic import replaced_atomically
from htfl_dist.payload import Payload, PayloadSpec

GENERATED_DIR = "generated"
IMAGE_FIELD = "images"
MIN_TILE_PX = 56
GAP_PX = 2
MAX_COLUMNS = 10


def grid_picture(images: torch.Tensor) -> Image.Image:
    """[n, c, h, w] images normalised as the clients' data ((x − 0.5)/0.5) → one PIL grid."""
    count, channels, height, width = images.shape
    zoom = max(1, math.ceil(MIN_TILE_PX / max(height, width)))
    pixels = ((images.float().cpu() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    pixels = pixels.repeat_interleave(zoom, dim=2).repeat_interleave(zoom, dim=3)
    columns = min(count, MAX_COLUMNS)
    rows = math.ceil(count / columns)
    tile_h, tile_w = height * zoom, width * zoom
    canvas = np.full((rows * (tile_h + GAP_PX) - GAP_PX, columns * (tile_w + GAP_PX) - GAP_PX, channels), 255,
                     dtype=np.uint8)
    for index in range(count):
        top, left = (index // columns) * (tile_h + GAP_PX), (index % columns) * (tile_w + GAP_PX)
        canvas[top : top + tile_h, left : left + tile_w] = pixels[index].permute(1, 2, 0).numpy()
    return Image.fromarray(canvas[..., 0] if channels == 1 else canvas)


class GeneratedImageGrids:
    """Rank 0's writer of ``generated/round_NNNNN.png`` for algorithms whose download has images."""

    def __init__(self, out_dir: Path, download_spec: PayloadSpec) -> None:
        self.directory = Path(out_dir) / GENERATED_DIR
        self.enabled = any(f.name == IMAGE_FIELD and len(f.trailing_shape) == 3 for f in download_spec)
        self.last: torch.Tensor | None = None

    def save(self, round_number: int, download: Payload) -> Path | None:
        """Write this round's grid if there are images and they changed; returns the file written."""
        images = download.get(IMAGE_FIELD) if self.enabled else None
        if images is None or images.shape[0] == 0:
            return None
        if self.last is not None and torch.equal(images, self.last):
            return None
        path = self.directory / f"round_{round_number:05d}.png"
        with replaced_atomically(path) as tmp:
            grid_picture(images).save(tmp, format="PNG")
        self.last = images.clone()
        return path
