"""The model-part sharing block: which module a part names, the identical-part check, the server's
average worked by hand, and a FedPer-style method (FedAvg over the feature extractor) written on
the block in a few lines and played through the real round loop in this process."""
from __future__ import annotations

import pytest
import torch
from fedper_parts import FedPerClient, FedPerOptions, FedPerServer

from conftest import SMOKE
from htfl_dist.algorithms import AlgorithmContext, register_algorithm, registry
from htfl_dist.algorithms.blocks.model_part import (
    FEATURE_EXTRACTOR,
    HEAD,
    WHOLE_MODEL,
)
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.runtime.simulate import simulate


@pytest.fixture
def fedper(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())
    register_algorithm("fedper", server=FedPerServer, client=FedPerClient, options=FedPerOptions,
                       summary="FedAvg over the feature extractor, local heads", shares_parameters=True,
                       evaluation_installs_knowledge=True)


def context(group: str, num_clients: int = 3, **options) -> AlgorithmContext:
    return AlgorithmContext(num_classes=3, feature_dim=4, seed=0, train=TrainConfig(batch_size=4, lr=0.05),
                            options=FedPerOptions(**options), num_clients=num_clients, model_group=group)


def test_a_part_names_the_head_the_extractor_or_the_whole_model():
    model = torch.nn.Module()
    model.head, model.feature_extractor = torch.nn.Linear(2, 2), torch.nn.Linear(3, 2)
    assert HEAD.of(model) is model.head
    assert FEATURE_EXTRACTOR.of(model) is model.feature_extractor
    assert WHOLE_MODEL.of(model) is model


def test_what_the_download_replaces_is_the_parts_parameters_by_their_model_names():
    """The names parking leaves out are the model's own state-dict keys of the part's parameters:
    the head's under ``head.``, the whole model's all of its parameters, never a buffer."""
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.head, model.feature_extractor = torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(3)
    client = SimpleNamespace(model=model)
    for part, expected in ((HEAD, {"head.weight", "head.bias"}),
                           (WHOLE_MODEL, {"head.weight", "head.bias", "feature_extractor.weight",
                                          "feature_extractor.bias"})):
        sharing = type("Sharing", (FedPerClient,), {"part": part})(context("HtCNN8"))
        assert sharing.replaced_by_download(client) == expected
        assert expected <= set(model.state_dict())


def test_the_wire_row_counts_the_part_alone():
    # HtCNN8's head is Linear(K=4, C=3): 4·3 + 3 = 15 floats; the extractor and the model are larger.
    ctx = context("HtCNN8")
    assert HEAD.floats(ctx) == 15
    assert HEAD.field(ctx).trailing_shape == (15,)
    assert WHOLE_MODEL.floats(ctx) == FEATURE_EXTRACTOR.floats(ctx) + 15


def test_heterogeneous_parts_are_refused_naming_the_first_client_that_differs():
    ctx = context("HtCNN8", num_clients=3)
    HEAD.check(ctx, "FedPer")  # every HtCNN8 member ends in Linear(K, C)
    with pytest.raises(ConfigError) as info:
        FEATURE_EXTRACTOR.check(ctx, "FedPer")
    message = str(info.value)
    assert message.startswith("FedPer shares the feature extractor, so all feature extractors must be identical; "
                              "client 1 (htcnn2) has {")
    assert "but client 0 (htcnn1) has {" in message
    with pytest.raises(ConfigError, match="all models must be identical; client 1 "):
        WHOLE_MODEL.check(ctx, "FedPer")
    FEATURE_EXTRACTOR.check(context("htcnn2", num_clients=5), "FedPer")  # homogeneous: accepted
    FEATURE_EXTRACTOR.check(context("HtCNN8", num_clients=1), "FedPer")  # one client: nothing to differ


def _upload(value: float, count: int, width: int) -> dict:
    return {"feature_extractor": torch.full((1, width), value), "num_samples": torch.tensor([count])}


def test_the_server_starts_from_client_0_and_averages_by_hand():
    ctx = context("cnn", num_clients=3)
    server = FedPerServer(ctx)
    width = server.row.shape[1]
    from htfl_dist.algorithms.parameters import initial_model_of, parameter_row
    assert torch.equal(server.row, parameter_row(initial_model_of(ctx, 0).feature_extractor))
    # n = 1, 3 (client ids 4, 2: the sum runs in id order): (1·1 + 3·5) / 4 = 4 on every entry
    diagnostics = server.update({4: _upload(1.0, 1, width), 2: _upload(5.0, 3, width)}, 0, torch.Generator())
    assert torch.allclose(server.row, torch.full((1, width), 4.0))
    assert diagnostics["feature_extractor_uploads"] == 2
    assert torch.equal(parameter_row(server.module), server.row)  # the module follows the row
    uniform = FedPerServer(context("cnn", avg="uniform"))
    uniform.update({0: _upload(1.0, 1, width), 1: _upload(5.0, 3, width)}, 0, torch.Generator())
    assert torch.allclose(uniform.row, torch.full((1, width), 3.0))


def test_the_server_refuses_two_rows_and_bad_counts():
    server = FedPerServer(context("cnn"))
    width = server.row.shape[1]
    bad = _upload(1.0, 1, width)
    bad["feature_extractor"] = torch.zeros(2, width)
    with pytest.raises(ProtocolError, match=r"^client 7 sent 2 feature_extractor rows, expected 1$"):
        server.validate_upload(7, bad)
    with pytest.raises(ProtocolError, match=r"num_samples=\[0\]"):
        server.validate_upload(7, _upload(1.0, 0, width))
    state = server.state_dict()
    assert list(state) == ["feature_extractor"]
    fresh = FedPerServer(context("cnn"))
    fresh.load_state_dict({"feature_extractor": torch.ones(1, width)})
    assert torch.equal(fresh.row, torch.ones(1, width))


@pytest.mark.integration
def test_fedper_on_the_block_plays_real_rounds(fedper, tmp_path, cache_dir):
    rows = simulate(SMOKE, ["algorithm=fedper", "model.group=cnn", "rounds=2", "num_clients=4",
                            f"data.cache_dir={cache_dir}"], out=tmp_path)
    assert [row["round"] for row in rows] == [1, 2]
    assert all(row["feature_extractor_uploads"] == 4 for row in rows)
    assert rows[1]["test_acc"] > 0.2  # 10 classes: chance is 0.1
    # the paper's count is the extractor alone; the wire adds a sample count and framing
    assert all(1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.01 for row in rows)


def test_fedper_refuses_a_heterogeneous_group_before_any_round(fedper, tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="FedPer shares the feature extractor"):
        simulate(SMOKE, ["algorithm=fedper", "rounds=1", f"data.cache_dir={cache_dir}"], out=tmp_path)
