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
    """``module``'s parameters as a float32 [1, P] row on the CPU (a copy)."""
    return parameters_to_vector(module.parameters()).detach().float().cpu().reshape(1, -1).clone()


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
    mean = torch.zeros_like(rows[0], dtype=torch.float64)
    for row, share in zip(rows, shares, strict=True):
        mean += row.double() * (share / total)
    return mean.float()


def initial_model_of(context: AlgorithmContext, client_id: int) -> SplitModel:
    """Client ``client_id``'s initial model, rebuilt bit for bit on the server (on the context's
    device) without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        model = initial_client_model(context.model_group, client_id, context.seed,
                                     num_classes=context.num_classes, feature_dim=context.feature_dim,
                                     inputs=context.inputs,
                                     init=context.model_init)
    return model.to(context.device)
