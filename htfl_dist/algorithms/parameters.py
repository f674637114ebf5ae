"""Model parts on the wire: flattened parameter vectors and their averages (``blocks.model_part``
builds the sharing methods on them).

The baselines whose papers share model parameters (LG-FedAvg's and FedGen's heads, FedGH's
head, FML's and FedKD's shared model, FedGen's generator) declare each shared module as one
payload field: a single row holding the module's parameters flattened in ``named_parameters``
order. Never pickled modules, and the receiver knows the shape from its own copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from htfl_dist.algorithms.interface import AlgorithmContext
from htfl_dist.models import SplitModel, initial_client_model
from htfl_dist.payload import Field


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_field(name: str, module: nn.Module) -> Field:
    """A payload field carrying ``module``'s parameters as one float32 row."""
    return Field(name, torch.float32, (parameter_count(module),), max_rows=1)


@torch.no_grad()
def parameter_row(module: nn.Module) -> torch.Tensor:
    """``module``'s parameters as a float32 [1, P] row on the CPU (a copy: ``parameters_to_vector``
    concatenates into a new tensor, even for one parameter, so no further clone is needed)."""
    return parameters_to_vector(module.parameters()).detach().float().cpu().reshape(1, -1)


@torch.no_grad()
def load_parameter_row(module: nn.Module, row: torch.Tensor) -> None:
    """Copy a row made by :func:`parameter_row` into ``module``'s parameters, in place: the
    parameters keep their own storage (``vector_to_parameters`` would make them views of the row,
    which is shared by every client of a rank)."""
    vector = row.reshape(-1)
    if vector.numel() != parameter_count(module):
        raise ValueError(f"a row of {vector.numel()} values for a module of {parameter_count(module)} parameters")
    offset = 0
    for parameter in module.parameters():
        parameter.copy_(vector[offset : offset + parameter.numel()].view_as(parameter))
        offset += parameter.numel()


def average_rows(rows: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """Σ_i w_i · row_i with w_i = weights_i / Σ weights (uniform without weights), summed in float64
    in the given order (callers pass client-id order, so the mean does not depend on ranks)."""
    if not rows:
        raise ValueError("average of no rows")
    shares = [1.0] * len(rows) if weights is None else [float(w) for w in weights]
    total = sum(shares)
    factors = [share / total for share in shares]
    flat = [row.reshape(-1) for row in rows]
    mean = torch.zeros(flat[0].shape, dtype=torch.float64, device=flat[0].device)
    scratch = torch.empty(min(_AVERAGE_CHUNK, mean.numel()), dtype=torch.float64, device=mean.device)
    for start in range(0, mean.numel(), _AVERAGE_CHUNK):
        # per chunk and in row order, the same float64 operations as ``mean += row.double() * factor``
        # (so the same bits), through one preallocated buffer that stays in cache: the whole-row form
        # allocated two float64 rows per upload, ~0.5 s a round for 50 pfl CNNs in page faults
        target = mean[start : start + _AVERAGE_CHUNK]
        buffer = scratch[: target.numel()]
        for row, factor in zip(flat, factors, strict=True):
            buffer.copy_(row[start : start + _AVERAGE_CHUNK])
            target.add_(buffer.mul_(factor))
    return mean.float().reshape(rows[0].shape)


_AVERAGE_CHUNK = 1 << 15
"""Elements per chunk of :func:`average_rows`: 256 KiB of float64, a buffer and a target that fit a
core's L2 cache."""


def initial_model_of(context: AlgorithmContext, client_id: int) -> SplitModel:
    """Client ``client_id``'s initial model, rebuilt bit for bit on the server (on the context's
    device) without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        model = initial_client_model(context.model_group, client_id, context.seed,
                                     num_classes=context.num_classes, feature_dim=context.feature_dim,
                                     inputs=context.inputs, options=context.model_options,
                                     init=context.model_init)
    return model.to(context.device)
