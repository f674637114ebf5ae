"""Uploads summed where they are made (``runtime.presum_uploads``): the fixed point worked by
hand, sums that do not depend on how the clients are split over ranks (bit for bit), the refusals,
and real runs: one process against the per-client path, three ranks against one process."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import SMOKE, run_smoke
from htfl_dist.errors import ConfigError
from htfl_dist.runtime.presum import add_fixed, finite_exponent, fraction_bits, from_fixed
from htfl_dist.runtime.session import checked_config
from htfl_dist.runtime.simulate import simulate

PRESUM = ("runtime.presum_uploads=true",)


def to_fixed(values: torch.Tensor, exponent: int, bits: int) -> torch.Tensor:
    """One contribution alone in fixed point: added to a zero total."""
    total = torch.zeros(values.shape, dtype=torch.int64)
    add_fixed(total, values, exponent, bits)
    return total


def test_fixed_point_by_hand():
    """e = 1 (|x| ≤ 2), k = 4 bits below it: a unit of 2^(1−4) = 1/8; 0.75 → 6, −1.3 → −10.4 → −10,
    0.0625 → 0.5 → 0 (ties to even), 0.1875 → 1.5 → 2."""
    values = torch.tensor([0.75, -1.3, 0.0625, 0.1875], dtype=torch.float64)
    assert finite_exponent(values) == 1
    assert to_fixed(values, 1, 4).tolist() == [6, -10, 0, 2]
    assert from_fixed(torch.tensor([6, -10]), 1, 4).tolist() == [0.75, -1.25]
    assert finite_exponent(torch.zeros(3)) == -1074 and finite_exponent(torch.tensor([1.0])) == 1
    assert fraction_bits(1000) == 52 and fraction_bits(2) == 61 and fraction_bits(6) == 59


def test_an_all_zero_or_subnormal_field_is_written_and_read_back_exactly():
    """e = −1074 for a field every participant holds at zero: the scale 2^(k − e) is 2^1130, past
    float64's range, and 0 · inf would have been NaN (written as int64's minimum). Subnormal
    entries come back exactly: 1e-310 is a multiple of 2^-1074, far above 2^(e − k)."""
    zeros = torch.zeros(5, dtype=torch.float64)
    assert to_fixed(zeros, -1074, 56).tolist() == [0] * 5
    assert from_fixed(torch.zeros(5, dtype=torch.int64), -1074, 56).tolist() == [0.0] * 5
    tiny = torch.tensor([1e-310, -3e-312, 0.0], dtype=torch.float64)
    exponent = finite_exponent(tiny)
    assert exponent == -1029 and torch.equal(from_fixed(to_fixed(tiny, exponent, 56), exponent, 56), tiny)


def test_adding_in_chunks_equals_the_whole_tensor_written_at_once():
    """``add_fixed`` converts a cache-sized chunk at a time: across the chunks' edges (3 chunks and
    a part), added to a running total, it writes what one conversion of the whole tensor writes."""
    from htfl_dist.runtime.presum import _FIXED_CHUNK

    generator = torch.Generator().manual_seed(1)
    values = torch.randn(3 * _FIXED_CHUNK + 7, generator=generator)  # float32, as uploads are
    exponent, bits = finite_exponent(values), fraction_bits(50)
    whole = torch.round(values.double() * 2.0 ** (bits - exponent)).to(torch.int64)
    total = torch.full((values.numel(),), 5, dtype=torch.int64)
    add_fixed(total, values, exponent, bits)
    assert torch.equal(total, whole + 5)


def test_nan_or_inf_in_a_contribution_is_refused_naming_the_client():
    """One pass (aminmax) both finds the field's exponent and refuses a non-finite entry; the
    gather names the client whose contribution holds it, before any sum is made."""
    from helpers import make_context

    from htfl_dist.errors import ProtocolError
    from htfl_dist.runtime.exchange import RoundTraffic
    from htfl_dist.runtime.presum import PresummedUploads
    from htfl_dist.runtime.transport import LocalTransport

    assert finite_exponent(torch.tensor([0.75, -1.3])) == 1 and finite_exponent(torch.zeros(0)) == -1074
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert finite_exponent(torch.tensor([0.5, bad, 2.0])) is None
    entry, context = make_context("FedProto")  # sums Σ prototype rows per class and their weights
    summing = PresummedUploads(LocalTransport(), entry, context, lambda rank: f"rank {rank}")
    upload = {"class_ids": torch.tensor([0, 2]), "protos": torch.ones(2, 4)}
    poisoned = {"class_ids": torch.tensor([1]), "protos": torch.tensor([[0.0, float("nan"), 1.0, 1.0]])}
    with pytest.raises(ProtocolError, match=r"^client 7's contribution 'row_sums' holds NaN or Inf$"):
        summing.gather({3: upload, 7: poisoned}, [3, 7], {3: 0, 7: 0}, 0, RoundTraffic())
    summed = summing.gather({3: upload}, [3], {3: 0}, 0, RoundTraffic())
    assert summed is not None and summed.uploaders == 1
    assert torch.equal(summed.sums["row_sums"][[0, 2]], torch.ones(2, 4, dtype=torch.float64))


def test_the_sum_is_the_same_however_the_clients_are_split():
    """Fixed-point sums of 50 contributions spanning 12 orders of magnitude: any order, any split
    into per-rank partial sums, the same bits; within 2^-k of the largest entry of the float sum."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(1000, generator=generator, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (1,)).item()
            for _ in range(50)]
    exponent, bits = max(finite_exponent(row) for row in rows), fraction_bits(50)
    fixed = [to_fixed(row, exponent, bits) for row in rows]
    in_order = from_fixed(torch.stack(fixed).sum(dim=0), exponent, bits)
    split = [sum(fixed[i] for i in part) for part in (range(0, 50, 3), range(1, 50, 3), range(2, 50, 3))]
    reversed_ranks = from_fixed(split[2] + split[0] + split[1], exponent, bits)
    assert torch.equal(in_order, reversed_ranks)
    exact = torch.stack(rows).sum(dim=0)
    assert float((in_order - exact).abs().max()) <= 50 * math.ldexp(1.0, exponent - bits)


@pytest.mark.parametrize(("overrides", "message"), [
    (("algorithm=fedtgp",), r"^runtime.presum_uploads: fedtgp's server reads each client's upload"),
    (("participation.drop_rate=0.2",), r"^runtime.presum_uploads runs without the simulated participation"),
    (("privacy.secure_aggregation=true",), r"^runtime.presum_uploads and privacy.secure_aggregation both sum"),
])
def test_what_presumming_cannot_run_with_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        checked_config(str(SMOKE), [*PRESUM, *overrides])


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["fedproto", "fml"])
def test_one_process_presummed_equals_the_per_client_path(algorithm, tmp_path, cache_dir):
    overrides = [f"data.cache_dir={cache_dir}", "rounds=2", f"algorithm={algorithm}"]
    summed = simulate(SMOKE, [*overrides, *PRESUM], out=tmp_path / "summed")
    plain = simulate(SMOKE, overrides, out=tmp_path / "plain")
    for a, b in zip(summed, plain, strict=True):
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=0.005)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


@pytest.mark.launch
def test_three_ranks_presummed_equal_one_process_bit_for_bit(tmp_path, cache_dir):
    """FML (a shared model): each of two client ranks sends one fixed-point sum; the rows equal one
    process's exactly, and fewer bytes go up than the six models do."""
    overrides = ("algorithm=fml", "rounds=2")
    single = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *overrides, *PRESUM], out=tmp_path / "single")
    plain = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *overrides], out=tmp_path / "plain")
    rows = run_smoke("torchrun", 3, tmp_path / "ranks", cache_dir, *overrides, *PRESUM)
    for key in ("test_acc", "test_acc_head", "train_loss"):
        assert [row[key] for row in rows] == [row[key] for row in single]
    assert all(row["bytes_up"] < alone["bytes_up"] for row, alone in zip(rows, plain, strict=True))


@pytest.mark.parametrize("shift", [None, 100, 101, 150, -60])
def test_float32_uploads_are_written_as_the_float64_path_writes_them(shift, monkeypatch):
    """Float32 values are scaled and rounded in float32 where that is exact: against the widened
    path on values with ties (k + ½ after scaling), subnormal and zero entries, and fields whose
    largest entry is ordinary (None), tiny (shifts past the float32 path's edge of 100, and 2^150,
    past float32's range) or huge (−60)."""
    import htfl_dist.runtime.presum as presum

    bits = fraction_bits(50)
    values = torch.randn(5000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    exponent = finite_exponent(values) if shift is None else bits - shift
    values = values * 2.0 ** (exponent - finite_exponent(values) - 1)  # |entry| ≤ 2^exponent
    unit = 2.0 ** (exponent - bits)
    values[:8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 0.0, -0.0], dtype=torch.float64) * unit  # ties
    values[8:12] = torch.tensor([1e-45, -1e-44, 1e-40, 2.0 ** -126], dtype=torch.float64)  # subnormals, least normal
    values = values.float()
    assert finite_exponent(values) <= exponent
    fast = to_fixed(values, exponent, bits)
    monkeypatch.setattr(presum, "_float32_exact", lambda dtype, shift: False)
    widened = to_fixed(values, exponent, bits)
    assert torch.equal(fast, widened)
    assert fast[:6].tolist() == [0, 2, 2, 0, -2, 4]  # ties to even
