"""Width-scaled sub-model slicing (HeteroFL static, FedRolex rolling, random).

Why: a client of rate p holds ceil(p * W) of the W channels of every hidden
layer of a global model. Both sides derive the kept indices from (rate, round,
mode, seed), so no index list travels; the server averages each global entry
over the clients that hold it (plain count per entry, as HeteroFL does) and
keeps entries nobody held.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from htfl_dist.seeding import torch_generator

SLICE_MODES = ("static", "rolling", "random")


def kept_width(width: int, rate: float) -> int:
    """Channels a client of ``rate`` keeps: ceil(rate * width), at least 1."""
    return max(1, min(width, math.ceil(rate * width)))


ROLL_DIRECTION = -1
"""FedRolex's window start moves to (-t) mod W at round t: its server takes the first k entries of
``torch.roll(torch.arange(W), t % W)``, whose first entry is (-t) mod W (AIoT-MLSys-Lab/FedRolex,
``resnet_server.py``, ``ResnetServerRoll.split_model``, commit 813510997e1802eb756d53baa4229c90ce5ac008)."""


def slice_indices(width: int, rate: float, mode: str, round_index: int = 0,
                  seed: int = 0, client: int = 0, direction: int = ROLL_DIRECTION) -> torch.Tensor:
    """Indices a client keeps in a layer of ``width`` channels.

    static: the first k (HeteroFL); rolling: k consecutive indices starting at
    (direction * round mod width), wrapping (FedRolex; ``direction`` -1 is its official code's,
    +1 the paper's Fig. 2 read left to right); random: a sorted random k-subset
    drawn from a generator seeded by (seed, client, round).
    """
    k = kept_width(width, rate)
    if mode == "static":
        return torch.arange(k)
    if mode == "rolling":
        if direction not in (-1, 1):
            raise ValueError(f"rolling direction must be -1 or +1, got {direction!r}")
        start = (direction * round_index) % width
        return (torch.arange(k) + start) % width
    if mode == "random":
        gen = torch_generator(seed, "width-slice", client, round_index)  # both sides derive it
        return torch.sort(torch.randperm(width, generator=gen)[:k]).values
    raise ValueError(f"unknown slice mode {mode!r}; expected one of {SLICE_MODES}")


def slice_tensor(tensor: torch.Tensor, index: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The sub-tensor at ``index`` (one index per leading dim; None = all)."""
    out = tensor
    for dim, idx in enumerate(index):
        if idx is not None:
            out = out.index_select(dim, idx)
    return out


def aggregate(global_state: dict[str, torch.Tensor],
              uploads: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Sequence[torch.Tensor | None]]]],
              ) -> dict[str, torch.Tensor]:
    """Mean of every global entry over the uploads that hold it; others kept."""
    result = {}
    for name, old in global_state.items():
        total = torch.zeros_like(old, dtype=torch.float64)
        count = torch.zeros_like(old, dtype=torch.float64)
        for state, indices in uploads:
            if name not in state:
                continue
            full = _open_grid(indices[name], old.shape)
            total[full] += state[name].double()
            count[full] += 1
        held = count > 0
        new = old.clone()
        new[held] = (total[held] / count[held]).to(old.dtype)
        result[name] = new
    return result


def _open_grid(indices: Sequence[torch.Tensor | None], shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """Broadcastable index tensors (like numpy.ix_) selecting the slice block."""
    n = len(indices)
    grid = []
    for dim, idx in enumerate(indices):
        full = idx if idx is not None else torch.arange(shape[dim])
        view = [1] * n
        view[dim] = -1
        grid.append(full.reshape(view))
    return tuple(grid)
