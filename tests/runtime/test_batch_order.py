"""The client training loop every algorithm shares: which samples each step sees
(train.batch_order, train.last_batch)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import TrainConfig, load_config
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator


def _client(count: int) -> ClientState:
    """Identity features, so sample i is the row (i, 0) and a batch tells which samples it holds."""
    model = SplitModel(nn.Identity(), nn.Linear(2, 2, bias=False), feature_dim=2)
    x = torch.stack([torch.arange(count, dtype=torch.float32), torch.zeros(count)], dim=1)
    y = torch.zeros(count, dtype=torch.int64)
    return ClientState(0, "linear", model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, x, y,
                       torch.device("cpu"))


def _batches(count: int, generator: torch.Generator | None = None, **train) -> tuple[list[list[int]], int]:
    """The sample indices of every step, in order, and the samples the loop reports."""
    client = _client(count)
    entry = get_algorithm("local")
    context = AlgorithmContext(num_classes=2, feature_dim=2, seed=0, train=TrainConfig(**train),
                               options=parse_options(entry, {}))
    steps: list[list[int]] = []

    def loss_fn(batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(batch.logits, batch.labels)

    def record(batch: Batch) -> None:
        steps.append([int(v) for v in batch.x[:, 0].tolist()])

    generator = generator if generator is not None else torch_generator(0, "batches", 0, 0)
    _, seen = run_local_training(client, context, loss_fn, generator, on_batch=record)
    return steps, seen


FIRST_TWENTY = [list(range(0, 10)), list(range(10, 20))]


def test_fixed_order_with_drop_sees_the_stored_order_without_the_partial_batch():
    # 23 samples, batch 10: HtFLlib's DataLoader(shuffle=False, drop_last=True) gives 0..9, 10..19
    # in every epoch; 20, 21, 22 are never trained on.
    steps, seen = _batches(23, batch_size=10, local_epochs=2, batch_order="fixed", last_batch="drop")
    assert steps == FIRST_TWENTY + FIRST_TWENTY
    assert seen == 40


def test_fixed_order_keeps_the_partial_batch_by_default():
    steps, seen = _batches(23, batch_size=10, local_epochs=1, batch_order="fixed")
    assert steps == [*FIRST_TWENTY, [20, 21, 22]]
    assert seen == 23


def test_keep_still_skips_a_trailing_batch_of_one_sample_but_drop_skips_any_size():
    assert _batches(21, batch_size=10, batch_order="fixed")[0] == FIRST_TWENTY
    assert _batches(29, batch_size=10, batch_order="fixed", last_batch="drop")[0] == FIRST_TWENTY


def test_drop_on_a_client_smaller_than_one_batch_trains_nothing():
    assert _batches(7, batch_size=10, last_batch="drop") == ([], 0)
    steps, seen = _batches(7, batch_size=10, batch_order="fixed")
    assert (steps, seen) == ([list(range(7))], 7)


def test_shuffled_order_is_a_fresh_permutation_per_epoch_and_drop_cuts_its_tail():
    generator = torch_generator(3, "batches", 5, 2)
    expected_generator = torch_generator(3, "batches", 5, 2)
    first, second = torch.randperm(23, generator=expected_generator), torch.randperm(23, generator=expected_generator)
    steps, seen = _batches(23, generator, batch_size=10, local_epochs=2, last_batch="drop")
    assert steps == [first[:10].tolist(), first[10:20].tolist(), second[:10].tolist(), second[10:20].tolist()]
    assert seen == 40
    assert first.tolist() != second.tolist()  # each epoch is reshuffled
    assert steps[:2] != FIRST_TWENTY  # ... so it is not the stored order


def test_fixed_order_draws_nothing_from_the_batch_stream():
    generator = torch_generator(0, "batches", 0, 0)
    before = generator.get_state().clone()
    _batches(23, generator, batch_size=10, batch_order="fixed")
    assert torch.equal(generator.get_state(), before)
    _batches(23, generator, batch_size=10)
    assert not torch.equal(generator.get_state(), before)


def test_fedproto_prototypes_during_training_come_from_the_batches_seen():
    """HtFLlib's FedProto averages the features of the batches it trained on: with fixed order and
    drop, samples 20..22 (features 20, 21, 22) are not in the prototype."""
    entry = get_algorithm("fedproto")
    options = parse_options(entry, {"client_reg": "htfllib", "proto_from": "during_training"})
    context = AlgorithmContext(num_classes=2, feature_dim=2, seed=0, options=options,
                               train=TrainConfig(batch_size=10, batch_order="fixed", last_batch="drop"))
    client = _client(23)
    knowledge = {"class_ids": torch.zeros(0, dtype=torch.int64), "protos": torch.zeros(0, 2)}
    result = entry.client(context).train(client, knowledge, 0, torch_generator(0, "batches", 0, 0))
    assert result.upload["class_ids"].tolist() == [0]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[9.5, 0.0]]))  # mean of 0..19
    assert result.samples == 20


def test_options_are_checked_and_default_to_the_previous_behaviour():
    assert (TrainConfig().batch_order, TrainConfig().last_batch) == ("shuffled", "keep")
    with pytest.raises(ConfigError, match=r"^config key 'train.batch_order' is 'sorted'; allowed: shuffled, fixed$"):
        load_config(None, ["train.batch_order=sorted"])
    with pytest.raises(ConfigError, match=r"^config key 'train.last_batch' is True; allowed: keep, drop$"):
        load_config(None, ["train.last_batch=true"])


def test_defaults_written_out_keep_the_hash_and_the_reference_order_changes_it():
    base = load_config(None, []).config_hash()
    assert load_config(None, ["train.batch_order=shuffled", "train.last_batch=keep"]).config_hash() == base
    fixed = load_config(None, ["train.batch_order=fixed"]).config_hash()
    drop = load_config(None, ["train.last_batch=drop"]).config_hash()
    assert len({base, fixed, drop}) == 3


def test_model_init_default_keeps_the_hash_and_htfllib_changes_it():
    base = load_config(None, []).config_hash()
    assert load_config(None, ["model.init=per_client"]).config_hash() == base
    assert load_config(None, ["model.init=htfllib"]).config_hash() != base
    with pytest.raises(ConfigError, match=r"^config key 'model.init' is 'zero'; allowed: per_client, htfllib$"):
        load_config(None, ["model.init=zero"])


@pytest.mark.integration
def test_each_client_round_draws_its_batches_from_the_stream_of_its_id_and_the_round(tmp_path, cache_dir, monkeypatch):
    """The runtime hands ``train`` the (seed, "batches", client, round) stream: the order is the
    client's own and new every round, wherever and beside whom the client trains."""
    from conftest import SMOKE
    from htfl_dist.algorithms import training
    from htfl_dist.runtime.simulate import simulate
    from htfl_dist.seeding import derive_seed

    seeds: list[int] = []
    real = training.epoch_batches

    def recorded(count, train, generator, device):
        seeds.append(generator.initial_seed())
        return real(count, train, generator, device)

    monkeypatch.setattr(training, "epoch_batches", recorded)
    simulate(SMOKE, [f"data.cache_dir={cache_dir}", "rounds=2"], out=tmp_path / "run")
    assert seeds == [derive_seed(0, "batches", client, round_index) for round_index in (0, 1) for client in range(6)]
