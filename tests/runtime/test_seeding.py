"""The global generator's seeding (htfl_dist.seeding.seed_global_torch) by hand: it must leave
torch's generators exactly where ``torch.manual_seed`` would, whichever path it takes."""
from __future__ import annotations

import hashlib

import torch

from htfl_dist import seeding


def test_the_seed_is_the_first_eight_bytes_of_the_sha256_of_the_keys():
    digest = hashlib.sha256(b"7:train:3:2").digest()
    assert seeding.derive_seed(7, "train", 3, 2) == int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def test_the_global_generator_draws_as_after_torch_manual_seed():
    seeding.seed_global_torch(7, "train", 3, 2)
    ours = torch.rand(6), torch.nn.Linear(4, 3).weight.detach().clone()
    torch.manual_seed(seeding.derive_seed(7, "train", 3, 2))
    reference = torch.rand(6), torch.nn.Linear(4, 3).weight.detach().clone()
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_where_an_accelerator_may_start_later_its_seed_is_queued_by_torch(monkeypatch):
    # the direct path would leave a CUDA started later at its default seed: there torch.manual_seed runs
    calls = []
    monkeypatch.setattr(seeding, "_accelerator_may_start", lambda: True)
    monkeypatch.setattr(torch, "manual_seed", lambda value: calls.append(value))
    seeding.seed_global_torch(7, "train", 3, 2)
    assert calls == [seeding.derive_seed(7, "train", 3, 2)]
