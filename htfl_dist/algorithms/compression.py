"""FedKD's SVD codec: energy-thresholded truncated SVD of each parameter,
as pure functions of tensors, and its wire form (a rank header plus flattened factors).

Two rank rules:

* ``fixed`` (default, [I]): a tensor with ndim ≥ 2 and shape[0] > 1 is seen as the matrix
  [shape[0], rest]; r = min{n ≥ 1 : Σ_{j≤n} σ_j² ≥ T·Σσ²} (never 0); the tensor is sent raw when
  r·(m+n+1) ≥ m·n (the factors would cost more).
* ``htfllib`` ([C] HtFLlib ``decomposition`` and the official FedKD ``run.py``): a 4-D conv
  weight [o, i, kh, kw] is decomposed per kh×kw slice, with one rank for all slices chosen from the
  per-index energies pooled over the slices; any other tensor with ndim ≥ 2 and shape[0] > 1 as
  the matrix [shape[0], rest] ([I] for ndim 3 or ≥ 5, which the reference mangles).
  r = the first n ∈ {0 … len(σ)−1} with Σ_{j<n} σ_j² > T·Σσ², and r = 0 when there is none: the
  tensor then arrives as zeros (the reference's off-by-one). Never raw for cost.

Both: tensors with ndim < 2 or shape[0] = 1, and tensors with Σσ² = 0, are sent raw (rank −1).
HtFLlib's exclusion of parameters named ``embeddings`` is not implemented: no model in the zoo
has one.

Costs in floats: raw = numel, matrix = r(m+n+1), slices = o·i·r(kh+kw+1).
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from htfl_dist.payload import Field, Payload, PayloadSpec

RankRule = Literal["fixed", "htfllib"]
RAW = -1
"""Rank header value of a tensor sent as it is."""


def layout(shape: tuple[int, ...], rule: RankRule) -> str:
    """``raw`` (never decomposed), ``matrix`` ([shape[0], rest]) or ``slices`` (per kh×kw slice)."""
    if len(shape) < 2 or shape[0] <= 1:
        return "raw"
    if rule == "htfllib" and len(shape) == 4:
        return "slices"
    return "matrix"


def _dims(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def max_rank(shape: tuple[int, ...], rule: RankRule) -> int:
    """len(σ): the number of singular values per matrix (0 for raw tensors)."""
    kind = layout(shape, rule)
    if kind == "raw":
        return 0
    return min(shape[2], shape[3]) if kind == "slices" else min(_dims(shape))


def select_rank(energies: torch.Tensor, energy: float, rule: RankRule) -> int:
    """The kept rank from the per-index energies e_j = σ_j² (pooled over slices), largest first.

    fixed: min{n ≥ 1 : Σ_{j≤n} e_j ≥ T·Σe}; htfllib: first n ∈ {0 … len(e)−1} with
    Σ_{j<n} e_j > T·Σe, else 0."""
    energies = energies.double()
    total = float(energies.sum())
    cumulative = torch.cumsum(energies, dim=0).tolist()  # cumulative[n-1] = Σ of the first n
    threshold = energy * total
    if rule == "fixed":
        for n, value in enumerate(cumulative, start=1):
            if value >= threshold:
                return n
        return len(cumulative)  # T = 1 and rounding: keep everything
    for n in range(len(cumulative)):
        if (cumulative[n - 1] if n > 0 else 0.0) > threshold:
            return n
    return 0


def factor_shapes(shape: tuple[int, ...], rank: int, rule: RankRule
                  ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of (u, s, v) for a tensor of ``shape`` sent at ``rank`` (raw: u = the tensor)."""
    if rank == RAW:
        return tuple(shape), (0,), (0,)
    if layout(shape, rule) == "slices":
        o, i, kh, kw = shape
        return (o, i, kh, rank), (o, i, rank), (o, i, rank, kw)
    m, n = _dims(shape)
    return (m, rank), (rank,), (rank, n)


def compressed_cost(shape: tuple[int, ...], rank: int, rule: RankRule) -> int:
    """Floats on the wire, as the FedKD paper counts them: numel raw, r(m+n+1) for a matrix,
    o·i·r(kh+kw+1) for slices."""
    if rank == RAW:
        return math.prod(shape)
    if layout(shape, rule) == "slices":
        o, i, kh, kw = shape
        return o * i * rank * (kh + kw + 1)
    m, n = _dims(shape)
    return rank * (m + n + 1)


def allowed_ranks(shape: tuple[int, ...], rule: RankRule) -> range | tuple[int, ...]:
    """Ranks a sender following ``rule`` can declare besides RAW."""
    if layout(shape, rule) == "raw":
        return ()
    k = max_rank(shape, rule)
    return range(1, k + 1) if rule == "fixed" else range(0, k)


def _svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD (u, s, vᵀ) in float64: float32 LAPACK leaves errors of ~1e-6·σ_1 in every entry,
    visible on the server's averages. A wide matrix (m < n, e.g. a 512×4608 linear layer) is
    decomposed as its transpose, A = (Aᵀ)ᵀ = v·diag(s)·uᵀ: the same factors up to rounding and the
    signs of paired singular vectors, but LAPACK's tall path is several times faster there."""
    rows, columns = matrix.shape[-2:]
    if rows >= columns:
        return torch.linalg.svd(matrix, full_matrices=False)
    u, s, v = torch.linalg.svd(matrix.mT, full_matrices=False)
    return v.mT, s, u.mT


@torch.no_grad()
def svd_compress(tensor: torch.Tensor, energy: float, rule: RankRule
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(u, s, v, rank) of ``tensor`` (float32 factors, on the CPU): ``tensor ≈ svd_recover(u, s, v, rank, …)``
    keeping the share ``energy`` (T) of Σσ² under ``rule``. rank = RAW (−1): u is the tensor
    itself and s, v are empty."""
    shape = tuple(tensor.shape)
    tensor = tensor.detach().to("cpu", torch.float32)
    empty = torch.empty(0)
    kind = layout(shape, rule)
    if kind == "raw":
        return tensor.clone(), empty, empty, RAW
    matrix = tensor if kind == "slices" else tensor.reshape(_dims(shape))
    u, s, v = _svd(matrix.double())  # slices: batched over (o, i)
    energies = s.square()
    if kind == "slices":
        energies = energies.sum(dim=(0, 1))
    if float(energies.sum()) == 0.0:
        return tensor.clone(), empty, empty, RAW
    rank = select_rank(energies, energy, rule)
    if rule == "fixed" and compressed_cost(shape, rank, rule) >= math.prod(shape):
        return tensor.clone(), empty, empty, RAW
    return (u[..., :rank].float().contiguous(), s[..., :rank].float().contiguous(),
            v[..., :rank, :].float().contiguous(), rank)


@torch.no_grad()
def svd_recover(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor, rank: int, shape: tuple[int, ...],
                rule: RankRule) -> torch.Tensor:
    """The float32 tensor of ``shape`` that (u, s, v, rank) encode: u·diag(s)·v per matrix (zeros
    at rank 0), or u itself when raw. Factors may come flattened."""
    shape = tuple(shape)
    u_shape, s_shape, v_shape = factor_shapes(shape, rank, rule)
    if rank == RAW:
        return u.reshape(shape).to(torch.float32).clone()
    u, s, v = (t.reshape(size).double() for t, size in ((u, u_shape), (s, s_shape), (v, v_shape)))
    return ((u * s.unsqueeze(-2)) @ v).reshape(shape).to(torch.float32)


# --------------------------------------------------------------------------- wire form


def compressed_fields(shapes: list[tuple[int, ...]]) -> PayloadSpec:
    """``ranks`` int64 [count] (RAW = −1 for a raw tensor), then per tensor i the flattened factors
    ``p{i}.u``, ``p{i}.s``, ``p{i}.v`` (float32 [numel]); a raw tensor travels in ``u``.

    Each factor holds at most the tensor's numel values (raw: u is the tensor; a rank-r factor
    of an m×n matrix has m·r or r·n values with r ≤ min(m, n); conv slices likewise), so that is
    its ``max_rows``: rank 0 bounds what a rank may announce by the model, not only by
    runtime.max_message_mb."""
    fields = [Field("ranks", torch.int64, max_rows=len(shapes))]
    for index, shape in enumerate(shapes):
        numel = math.prod(shape)
        fields += [Field(f"p{index}.{part}", torch.float32, max_rows=numel) for part in ("u", "s", "v")]
    return tuple(fields)


def compress_tensors(tensors: list[torch.Tensor], energy: float, rule: RankRule) -> tuple[Payload, int]:
    """The wire payload of ``tensors`` and its cost in floats (Σ_p cost_p, as the FedKD paper counts it)."""
    payload: Payload = {}
    ranks, cost = [], 0
    for index, tensor in enumerate(tensors):
        u, s, v, rank = svd_compress(tensor, energy, rule)
        payload[f"p{index}.u"], payload[f"p{index}.s"], payload[f"p{index}.v"] = \
            u.reshape(-1), s.reshape(-1), v.reshape(-1)
        ranks.append(rank)
        cost += compressed_cost(tuple(tensor.shape), rank, rule)
    payload["ranks"] = torch.tensor(ranks, dtype=torch.int64)
    return payload, cost


def empty_compressed(shapes: list[tuple[int, ...]]) -> Payload:
    """A payload of the declared fields with no rows (nothing to send yet)."""
    return {field.name: torch.empty(0, dtype=field.dtype) for field in compressed_fields(shapes)}


def float_count(payload: Payload, count: int) -> int:
    """Floats actually carried by a compressed payload of ``count`` tensors (a diagnostic)."""
    return sum(payload[f"p{i}.{part}"].numel() for i in range(count) for part in ("u", "s", "v"))


def payload_cost(payload: Payload, shapes: list[tuple[int, ...]], rule: RankRule) -> int:
    """Σ_p cost_p of a (checked) payload, as the FedKD paper counts it; 0 for an empty payload."""
    if payload["ranks"].numel() == 0:
        return 0
    return sum(compressed_cost(shape, int(rank), rule) for shape, rank in zip(shapes, payload["ranks"].tolist(),
                                                                              strict=True))


def check_compressed(payload: Payload, shapes: list[tuple[int, ...]], rule: RankRule) -> str | None:
    """What is wrong with a compressed payload of tensors of ``shapes`` (None: nothing): one rank
    per tensor, each RAW or one a ``rule`` sender can choose, factor sizes matching it."""
    ranks = payload["ranks"]
    if ranks.shape[0] != len(shapes):
        return f"{ranks.shape[0]} ranks for {len(shapes)} parameters"
    for index, (shape, rank) in enumerate(zip(shapes, ranks.tolist(), strict=True)):
        if rank != RAW and rank not in allowed_ranks(shape, rule):
            return f"rank {rank} for parameter {index} of shape {list(shape)} (rule {rule})"
        for part, expected in zip(("u", "s", "v"), factor_shapes(shape, rank, rule), strict=True):
            got = payload[f"p{index}.{part}"].numel()
            if got != math.prod(expected):
                return f"{got} values in p{index}.{part}, expected {math.prod(expected)} for rank {rank} " \
                       f"of shape {list(shape)}"
    return None


def recover_tensors(payload: Payload, shapes: list[tuple[int, ...]], rule: RankRule) -> list[torch.Tensor]:
    """The float32 CPU tensors a checked payload encodes, in order."""
    ranks = payload["ranks"].tolist()
    return [svd_recover(payload[f"p{i}.u"].cpu(), payload[f"p{i}.s"].cpu(), payload[f"p{i}.v"].cpu(), rank,
                        shape, rule) for i, (shape, rank) in enumerate(zip(shapes, ranks, strict=True))]
