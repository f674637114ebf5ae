"""Unit tests for the algorithm registry (registration, look-up and its one-line error, option
parsing and spelling out), the interface's defaults, and Local's plain cross-entropy training."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from htfl_dist.algorithms import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    algorithm_names,
    get_algorithm,
    parse_options,
    register_algorithm,
    registry,
    spelled_out_options,
)
from htfl_dist.algorithms.local import LocalClient, LocalOptions
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

# edges found by a mutmut pass


@dataclass
class _ToyOptions:
    knob: int = 1


class _ToyClient(ClientAlgorithm):
    pass


class _ToyServer(ServerAlgorithm):
    pass


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry, so a test can register names without touching the real one."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_register_stores_every_field_and_defaults_to_sharing_nothing(scratch_registry):
    register_algorithm("toy", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="a toy")
    entry = get_algorithm("toy")
    assert (entry.name, entry.server, entry.client, entry.options, entry.summary) == (
        "toy", _ToyServer, _ToyClient, _ToyOptions, "a toy")
    assert entry.shares_parameters is False and entry.uses_generator is False
    register_algorithm("toy2", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="another",
                       shares_parameters=True, uses_generator=True)
    other = get_algorithm("toy2")
    assert other.shares_parameters is True and other.uses_generator is True
    assert (other.name, other.summary) == ("toy2", "another")
    assert not (entry.private_release or entry.batched_clients or entry.evaluation_installs_knowledge)
    register_algorithm("toy3", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="declared",
                       private_release=True, batched_clients=True, evaluation_installs_knowledge=True)
    declared = get_algorithm("toy3")
    assert declared.private_release and declared.batched_clients and declared.evaluation_installs_knowledge


def test_evaluation_installs_knowledge_is_declared_exactly_where_prepare_evaluation_is_overridden():
    """The runtime hands ``prepare_evaluation`` a read-only look at a parked client unless the
    registry says the algorithm installs knowledge: an undeclared override would lose what it installs."""
    for name in algorithm_names():
        entry = get_algorithm(name)
        overrides = entry.client.prepare_evaluation is not ClientAlgorithm.prepare_evaluation
        assert entry.evaluation_installs_knowledge == overrides, name


def test_registering_a_name_twice_is_refused(scratch_registry):
    register_algorithm("toy", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="a toy")
    with pytest.raises(ValueError) as info:
        register_algorithm("toy", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="again")
    assert str(info.value) == "algorithm 'toy' registered twice"
    assert get_algorithm("toy").summary == "a toy"  # the first registration stands


def test_names_are_sorted_and_lookup_ignores_case():
    names = algorithm_names()
    assert names == sorted(names)
    assert {"feddistill", "fedgh", "lgfedavg", "local"} <= set(names)  # any new name may sort anywhere
    assert get_algorithm("FedGH").name == "fedgh"
    assert get_algorithm("LOCAL").client is LocalClient


def test_unknown_algorithm_is_a_one_line_error_listing_the_names():
    with pytest.raises(ConfigError) as info:
        get_algorithm("Nope")
    message = str(info.value)
    assert message == f"unknown algorithm 'Nope'; allowed: {', '.join(sorted(algorithm_names()))}"


def test_options_without_validate_are_parsed_and_spelled_out():
    assert isinstance(parse_options(get_algorithm("local"), {}), LocalOptions)  # LocalOptions has no validate
    assert spelled_out_options("local", {}) == {}
    # the defaults written out (FedDistill's None knobs resolved by its validate)
    assert spelled_out_options("FedDistill", {}) == {
        "compat": "paper", "distill_loss": "softmax", "missing_rows": "mask",
        "logits_from": "during_training", "reg_weight": 1.0}
    assert spelled_out_options("feddistill", {"compat": "htfllib", "reg_weight": 2.0}) == {
        "compat": "htfllib", "distill_loss": "raw", "missing_rows": "self_target",
        "logits_from": "during_training", "reg_weight": 2.0}
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        spelled_out_options("nope", {})
    with pytest.raises(ConfigError, match=r"algo\.reg_weight"):
        spelled_out_options("feddistill", {"reg_weight": -1.0})


# --------------------------------------------------------------------------- interface and Local


def _context(algorithm="local", lr=0.0):
    entry = get_algorithm(algorithm)
    return AlgorithmContext(num_classes=2, feature_dim=2, seed=0, train=TrainConfig(batch_size=2, lr=lr),
                            options=parse_options(entry, {}))


def _identity_client(lr=0.0) -> ClientState:
    """features = x and an identity head, so the logits are the inputs."""
    head = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
    model = SplitModel(nn.Identity(), head, feature_dim=2)
    x = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [0.0, math.log(3.0)], [1.0, 1.0]])
    y = torch.tensor([0, 1, 1, 0])
    return ClientState(0, "linear", model, torch.optim.SGD(model.parameters(), lr=lr), x, y, x, y,
                       torch.device("cpu"))


def test_interface_defaults():
    context = _context()
    client_side, server_side = ClientAlgorithm(context), ServerAlgorithm(context)
    client = _identity_client()
    assert client_side.theory_upload_floats(client) == 0
    assert server_side.theory_download_floats() == 0
    assert server_side.download() == {} and client_side.setup_upload(client) == {}
    logits = torch.tensor([[0.0, 5.0], [3.0, 1.0], [-1.0, -2.0]])
    # the argmax of every row (not of the flattened tensor)
    assert client_side.head_predict(client, logits).tolist() == [1, 0, 0]
    assert client_side.predict(client, {}, torch.zeros(3, 2), logits).tolist() == [1, 0, 0]


def test_local_trains_with_cross_entropy_and_uploads_nothing():
    context = _context()
    entry = get_algorithm("local")
    assert entry.server is ServerAlgorithm and entry.shares_parameters is False
    generator = torch_generator(0, "batches", 0, 0)
    before = generator.get_state().clone()
    result = entry.client(context).train(_identity_client(), {}, 0, generator)
    # lr 0, logits = x: CE(ln3, 0 | 0) = ln(4/3), CE(0, 0 | 1) = ln 2, CE(0, ln3 | 1) = ln(4/3),
    # CE(1, 1 | 0) = ln 2; loss_sum is the sum over the 4 samples (2 batches of 2)
    assert result.upload == {}
    assert result.samples == 4
    assert result.loss_sum == pytest.approx(2 * math.log(4 / 3) + 2 * math.log(2), rel=1e-6)
    assert not torch.equal(generator.get_state(), before)  # the batch order came from the round's stream


def test_local_batch_order_follows_the_given_stream_not_the_global_rng():
    """lr > 0: the result depends on the batch order, which must come from ``generator`` only."""
    context = _context(lr=0.5)
    algorithm = get_algorithm("local").client(context)
    results = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        client = _identity_client(lr=0.5)
        result = algorithm.train(client, {}, 0, torch_generator(0, "batches", 0, 0))
        results.append((result.loss_sum, client.model.head.weight.detach().clone()))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])
