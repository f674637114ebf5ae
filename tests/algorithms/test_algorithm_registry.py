"""Unit tests for the algorithm registry (registration, the capability flags derived from the
classes and the refusal of contradicting ones, the conformance hints, look-up and its one-line
error, option parsing and spelling out), the interface's defaults, and Local's plain
cross-entropy training."""
from __future__ import annotations

import math
import sys
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
from htfl_dist.algorithms.fedsa import FedSAClient
from htfl_dist.algorithms.local import LocalClient, LocalOptions
from htfl_dist.algorithms.registry import ConformanceHints, has_batched_path, installs_knowledge
from htfl_dist.config import PLUGIN_HINT, TrainConfig
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
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())


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
    assert entry.conformance == ConformanceHints() and entry.conformance.launched
    hints = ConformanceHints(overrides=["model.group=cnn"], ranks_covered_by="toy")
    register_algorithm("toy3", server=_ToyServer, client=_Batched, options=_ToyOptions, summary="declared",
                       private_release=True, batched_clients=True, evaluation_installs_knowledge=False,
                       conformance=hints)
    declared = get_algorithm("toy3")
    assert declared.private_release and declared.batched_clients and not declared.evaluation_installs_knowledge
    assert declared.conformance.overrides == ("model.group=cnn",) and not declared.conformance.launched


# ----------------------------------------------------------------------------- derived flags


class _Batched(ClientAlgorithm):
    def train(self, client, knowledge, round_index, generator):
        raise NotImplementedError

    def train_group(self, clients, knowledge, round_index, generators):
        raise NotImplementedError


class _ChangesTrain(_Batched):  # FedOC and FedSA below the prototype client
    def train(self, client, knowledge, round_index, generator):
        raise NotImplementedError


class _ChangesAHook(_Batched):  # FedProto below the prototype client: train and train_group both call it
    def make_upload(self):
        return {}


class _BatchesItsParentsTrain(_ChangesTrain):
    def train_group(self, clients, knowledge, round_index, generators):
        raise NotImplementedError


class _Installs(ClientAlgorithm):
    def prepare_evaluation(self, client, knowledge):
        pass


class _InheritsTheInstall(_Installs):
    pass


FLAGS_AS_DECLARED_BEFORE_THEY_WERE_DERIVED = {
    "feddistill": (False, False), "fedgen": (False, True), "fedgh": (False, True), "fedkd": (False, True),
    "fedktl": (False, False), "fedl2g": (False, False), "fedmrl": (False, True), "fedoc": (False, False),
    "fedproto": (True, False), "fedsa": (False, False), "fedtgp": (True, False), "fml": (False, False),
    "lgfedavg": (False, True), "local": (True, False),
}
"""(batched_clients, evaluation_installs_knowledge) as each registration passed them at c2990a8."""


def test_derivation_gives_every_algorithm_the_flags_it_declared():
    for name, flags in FLAGS_AS_DECLARED_BEFORE_THEY_WERE_DERIVED.items():
        entry = get_algorithm(name)
        assert (entry.batched_clients, entry.evaluation_installs_knowledge) == flags, name
        assert (has_batched_path(entry.client), installs_knowledge(entry.client)) == flags, name


@pytest.mark.parametrize(("client", "batched", "installs"), [
    (_ToyClient, False, False),  # the base's one-by-one train_group, the base's no-op prepare_evaluation
    (_Batched, True, False),
    (_ChangesTrain, False, False),  # it would batch its parent's train
    (_ChangesAHook, True, False),
    (_BatchesItsParentsTrain, True, False),  # a batched path written for the train it inherits
    (_Installs, False, True),
    (_InheritsTheInstall, False, True),
    (FedSAClient, False, False),
], ids=lambda value: getattr(value, "__name__", str(value)))
def test_flags_follow_where_the_methods_are_defined(scratch_registry, client, batched, installs):
    assert (has_batched_path(client), installs_knowledge(client)) == (batched, installs)
    register_algorithm("toy", server=_ToyServer, client=client, options=_ToyOptions, summary="derived")
    entry = get_algorithm("toy")
    assert (entry.batched_clients, entry.evaluation_installs_knowledge) == (batched, installs)


@pytest.mark.parametrize(("client", "flags", "message"), [
    (_Installs, {"evaluation_installs_knowledge": False},
     "algorithm 'toy' is registered with evaluation_installs_knowledge=False, but its client _Installs overrides "
     "prepare_evaluation (_Installs.prepare_evaluation); leave evaluation_installs_knowledge out (it is derived "
     "from the classes)"),
    (_InheritsTheInstall, {"evaluation_installs_knowledge": False},
     "algorithm 'toy' is registered with evaluation_installs_knowledge=False, but its client _InheritsTheInstall "
     "overrides prepare_evaluation (_Installs.prepare_evaluation); leave evaluation_installs_knowledge out (it is "
     "derived from the classes)"),
    (_ToyClient, {"evaluation_installs_knowledge": True},
     "algorithm 'toy' is registered with evaluation_installs_knowledge=True, but its client _ToyClient keeps the base "
     "prepare_evaluation, which installs nothing; leave evaluation_installs_knowledge out (it is derived from the "
     "classes)"),
    (_ToyClient, {"batched_clients": True},
     "algorithm 'toy' is registered with batched_clients=True, but its client _ToyClient trains a group one by one "
     "(train_group is the base's); leave batched_clients out (it is derived from the classes)"),
    (FedSAClient, {"batched_clients": True},
     "algorithm 'toy' is registered with batched_clients=True, but its client FedSAClient takes train from "
     "FedSAClient but train_group from PrototypeClient, which batches another train; leave batched_clients out "
     "(it is derived from the classes)"),
])
def test_a_flag_that_contradicts_the_classes_is_refused_in_one_line(scratch_registry, client, flags, message):
    with pytest.raises(ValueError) as info:
        register_algorithm("toy", server=_ToyServer, client=client, options=_ToyOptions, summary="wrong", **flags)
    assert str(info.value) == message
    assert "toy" not in algorithm_names()


def test_a_batched_path_may_be_declined_and_agreeing_flags_are_accepted(scratch_registry):
    register_algorithm("toy", server=_ToyServer, client=_Batched, options=_ToyOptions, summary="declined",
                       batched_clients=False)
    assert get_algorithm("toy").batched_clients is False  # train.client_batching=vmap is then refused
    register_algorithm("toy2", server=_ToyServer, client=_Installs, options=_ToyOptions, summary="agreeing",
                       batched_clients=False, evaluation_installs_knowledge=True)
    assert get_algorithm("toy2").evaluation_installs_knowledge is True


@pytest.mark.parametrize(("arguments", "message"), [
    ({"client": object}, "algorithm 'toy': client must be a ClientAlgorithm subclass, got <class 'object'>"),
    ({"conformance": {"overrides": ()}},
     "algorithm 'toy': conformance must be a ConformanceHints, got {'overrides': ()}"),
])
def test_a_client_or_hints_of_the_wrong_kind_are_refused(scratch_registry, arguments, message):
    with pytest.raises(ValueError) as info:
        register_algorithm("toy", **{"server": _ToyServer, "client": _ToyClient, "options": _ToyOptions,
                                     "summary": "wrong", **arguments})
    assert str(info.value) == message


@pytest.mark.parametrize(("hints", "message"), [
    ({"overrides": "model.group=cnn"}, "conformance overrides must be key=value strings, got 'model.group=cnn'"),
    ({"overrides": ("model.group",)}, "conformance overrides must be key=value strings, got ('model.group',)"),
    ({"ranks_covered_by": "fedgen", "ranks_checked_in": "tests/x.py"},
     "conformance hints name both ranks_covered_by and ranks_checked_in; name one"),
])
def test_hints_that_cannot_be_followed_are_refused(hints, message):
    with pytest.raises(ValueError) as info:
        ConformanceHints(**hints)
    assert str(info.value) == message


def test_registering_a_name_twice_is_refused_naming_both_places(scratch_registry):
    first = sys._getframe().f_lineno + 1
    register_algorithm("toy", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="a toy")
    with pytest.raises(ValueError) as info:
        register_algorithm("TOY", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="again")
    assert str(info.value) == (f"algorithm 'TOY' is already registered (as 'toy') by {__name__}, line {first}; "
                               f"{__name__}, line {first + 2} registers it again")
    assert get_algorithm("toy").summary == "a toy"  # the first registration stands
    with pytest.raises(ValueError, match=r"^algorithm 'toy' is already registered by "):  # said before other faults
        register_algorithm("toy", server=_ToyServer, client=object, options=_ToyOptions, summary="no client")


def test_a_mixed_case_name_is_listed_and_found_as_registered(scratch_registry):
    """Issue 46: "MyFedPer" was listed, yet refused under both spellings (the look-up lowered the
    name, the registration did not)."""
    register_algorithm("MyFedPer", server=_ToyServer, client=_ToyClient, options=_ToyOptions, summary="mixed")
    assert "MyFedPer" in algorithm_names()
    assert get_algorithm("MyFedPer").summary == get_algorithm("myfedper").summary == "mixed"
    assert get_algorithm("MYFEDPER").name == "MyFedPer"
    assert spelled_out_options("myfedper", {}) == {"knob": 1}


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
    assert message == (f"config key 'algorithm' is 'Nope'; registered: {', '.join(sorted(algorithm_names()))} "
                       f"({PLUGIN_HINT})")


def test_options_without_validate_are_parsed_and_spelled_out():
    assert isinstance(parse_options(get_algorithm("local"), {}), LocalOptions)  # LocalOptions has no validate
    assert spelled_out_options("local", {}) == {}
    # the defaults written out (FedDistill's None knobs resolved by its validate)
    assert spelled_out_options("FedDistill", {}) == {
        "compat": "paper", "distill_loss": "softmax", "missing_rows": "mask",
        "logits_from": "during_training", "reg_weight": 1.0}
    assert spelled_out_options("feddistill", {"compat": "reference", "reg_weight": 2.0}) == {
        "compat": "reference", "distill_loss": "raw", "missing_rows": "self_target",
        "logits_from": "during_training", "reg_weight": 2.0}
    with pytest.raises(ConfigError, match="config key 'algorithm' is 'nope'; registered: "):
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


def test_the_readme_counts_the_registered_algorithms():
    """README.md's "Algorithms today (N)" is the number of names in the registry, each named."""
    import re

    from conftest import REPO
    from htfl_dist.algorithms import algorithm_names

    readme = (REPO / "README.md").read_text()
    count = re.search(r"Algorithms today \((\d+)\)", readme)
    assert count is not None and int(count.group(1)) == len(algorithm_names())
