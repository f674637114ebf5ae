"""FML: options, the shared-model rule and its setup check, the server mean by hand, the client's
scratch copy of G, and one real run. The shared-model helpers here serve tests/algorithms/test_fedkd.py too."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import launch_smoke, make_client, make_context, roundtrip
from torch import nn

from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.algorithms import parameters as params
from htfl_dist.algorithms.shared_model import build_shared_model, check_shared_model, shared_member
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import SplitModel
from htfl_dist.models import registry as model_registry
from htfl_dist.seeding import seed_global_torch, torch_generator

# --------------------------------------------------------------------------- options


def test_defaults_are_the_tuned_values_and_compat_switches_kd():
    options = parse_options(get_algorithm("fml"), {})
    assert (options.alpha, options.beta, options.kd, options.avg, options.shared_model) == \
        (0.5, 0.5, "dml", "uniform", None)
    assert parse_options(get_algorithm("fml"), {"compat": "reference"}).kd == "htfllib"
    assert parse_options(get_algorithm("fml"), {"compat": "reference", "kd": "dml"}).kd == "dml"


@pytest.mark.parametrize("options,key", [
    ({"alpha": 1.5}, "algo.alpha"), ({"beta": -0.1}, "algo.beta"), ({"kd": "mutual"}, "algo.kd"),
    ({"avg": "median"}, "algo.avg"), ({"compat": "fedml"}, "algo.compat"),
    ({"shared_model": "bogus"}, "algo.shared_model"), ({"shared_model": "HtCNN8"}, "algo.shared_model"),
    ({"shared_model": "htcnn2:fc64"}, "algo.shared_model"),
])
def test_bad_options_name_their_key(options, key):
    for algorithm in ("fml", "fedkd"):
        if algorithm == "fedkd" and key in ("algo.alpha", "algo.beta", "algo.kd", "algo.avg"):
            continue
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
            parse_options(get_algorithm(algorithm), options)
        assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- the shared model


def test_shared_model_is_client_0s_member_and_identical_everywhere():
    _, context = make_context("fml", num_classes=10, feature_dim=16)
    assert shared_member(context) == "htcnn1"  # HtCNN8: client 0, not the smallest (htcnn2)
    first, second = build_shared_model(context), build_shared_model(context)
    assert torch.equal(params.parameter_row(first), params.parameter_row(second))
    before = torch.random.get_rng_state()
    build_shared_model(context)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's stream does not move
    _, other = make_context("fml", num_classes=10, feature_dim=16, shared_model="htcnn2")
    assert shared_member(other) == "htcnn2" and build_shared_model(other).arch == "htcnn2"


def test_shared_model_check_accepts_a_fitting_architecture():
    for algorithm in ("fml", "fedkd"):
        _, context = make_context(algorithm, num_classes=10, feature_dim=16, shared_model="resnet18")
        check_shared_model(context, algorithm)
        get_algorithm(algorithm).client.check_models(context)


class _Narrow(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :3]


class _ThreeChannel(nn.Module):
    def __init__(self, feature_dim):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.fc = nn.LazyLinear(feature_dim)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def _register_for_the_test(monkeypatch, **builders) -> None:
    """Register ``builders`` in a copy of the architecture registry that the test's end undoes."""
    monkeypatch.setattr(model_registry, "_ARCHITECTURES", model_registry._ARCHITECTURES.copy())
    for name, builder in builders.items():
        model_registry.register_architecture(name)(builder)


@pytest.fixture
def odd_architectures(monkeypatch):
    """Two architectures registered for one test only: features 3 wide, and 3-channel input only."""
    def narrow(*, num_classes, feature_dim, in_channels, image_size):
        return SplitModel(_Narrow(), nn.Linear(3, num_classes), feature_dim)

    def three_channel(*, num_classes, feature_dim, in_channels, image_size):
        return SplitModel(_ThreeChannel(feature_dim), nn.Linear(feature_dim, num_classes), feature_dim)

    _register_for_the_test(monkeypatch, test_narrow=narrow, test_rgb_only=three_channel)


@pytest.mark.parametrize("algorithm", ["fml", "fedkd"])
@pytest.mark.parametrize("member,needle", [
    ("test_narrow", "features of shape [3]"),
    ("test_rgb_only", "cannot take input [1, 28, 28]"),
])
def test_shared_model_check_refuses_what_does_not_fit(odd_architectures, algorithm, member, needle):
    _, context = make_context(algorithm, num_classes=10, feature_dim=16, shared_model=member)
    with pytest.raises(ConfigError) as info:
        get_algorithm(algorithm).client.check_models(context)
    message = str(info.value)
    assert needle in message and "algo.shared_model" in message and "\n" not in message
    assert message.startswith(f"{ {'fml': 'FML', 'fedkd': 'FedKD'}[algorithm]} shared model {member} ")


def test_shared_model_check_refuses_an_image_too_small():
    from dataclasses import replace

    _, context = make_context("fml", num_classes=10, feature_dim=16)
    with pytest.raises(ConfigError, match=r"algo\.shared_model") as info:
        check_shared_model(replace(context, image_size=2), "FML")
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- server


def _server(**options):
    entry, context = make_context("fml", num_classes=10, feature_dim=16, **options)
    return entry.server(context), context


def test_server_starts_from_the_clients_initial_shared_model():
    server, context = _server()
    assert torch.equal(server.download()["shared"], params.parameter_row(build_shared_model(context)))
    assert server.theory_download_floats() == params.parameter_count(build_shared_model(context))


def test_uniform_mean_by_hand():
    server, _ = _server()
    width = server.row.shape[1]
    uploads = {0: {"shared": torch.full((1, width), 1.0)}, 3: {"shared": torch.full((1, width), 4.0)}}
    for client_id, upload in uploads.items():
        server.validate_upload(client_id, upload)
    server.update(uploads, 0, torch_generator(0, "server", 0))
    assert torch.allclose(server.download()["shared"], torch.full((1, width), 2.5))  # (1 + 4) / 2


def test_sample_weighted_mean_by_hand():
    server, _ = _server(avg="sample_weighted")
    width = server.row.shape[1]
    uploads = {0: {"shared": torch.full((1, width), 1.0), "num_samples": torch.tensor([1])},
               1: {"shared": torch.full((1, width), 4.0), "num_samples": torch.tensor([3])}}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    assert torch.allclose(server.download()["shared"], torch.full((1, width), 3.25))  # (1·1 + 3·4) / 4


def test_bad_uploads_are_refused_and_state_round_trips():
    server, context = _server(avg="sample_weighted")
    width = server.row.shape[1]
    before = server.download()["shared"].clone()
    assert torch.equal(server.download()["shared"], before)
    with pytest.raises(ProtocolError, match="client 2"):
        server.validate_upload(2, {"shared": torch.zeros(2, width), "num_samples": torch.tensor([5])})
    with pytest.raises(ProtocolError, match="num_samples"):
        server.validate_upload(2, {"shared": torch.zeros(1, width), "num_samples": torch.tensor([0])})
    server.update({1: {"shared": torch.full((1, width), 7.0), "num_samples": torch.tensor([2])}}, 0,
                  torch_generator(0, "server", 0))
    fresh = get_algorithm("fml").server(context)
    fresh.load_state_dict(roundtrip(server.state_dict()))
    assert torch.equal(fresh.download()["shared"], server.download()["shared"])


# --------------------------------------------------------------------------- client


def test_client_trains_both_models_from_the_download_and_uploads_g():
    entry, context = make_context("fml", num_classes=3, feature_dim=8, batch_size=4, avg="sample_weighted")
    server = entry.server(context)
    knowledge = {name: tensor.clone() for name, tensor in server.download().items()}
    download = knowledge["shared"].clone()
    algorithm = entry.client(context)
    client = make_client(context, samples=9)
    local_before = params.parameter_row(client.model)
    seed_global_torch(0, "train", 0, 0)
    result = algorithm.train(client, knowledge, 0, torch_generator(0, "batches", 0, 0))
    assert torch.equal(knowledge["shared"], download)  # the shared download is not modified
    assert not torch.equal(params.parameter_row(client.model), local_before)  # M_i trained
    assert result.upload["shared"].shape == download.shape
    assert not torch.equal(result.upload["shared"], download)  # G_i trained
    assert result.upload["num_samples"].tolist() == [9]
    assert algorithm.theory_upload_floats(client) == download.shape[1]
    assert client.modules == {}  # FML keeps nothing between rounds
    # a second client (or round) starts from the download again, not from the first client's G_i
    seed_global_torch(0, "train", 0, 0)
    again = algorithm.train(make_client(context, samples=9), knowledge, 0, torch_generator(0, "batches", 0, 0))
    assert torch.equal(again.upload["shared"], result.upload["shared"])


def test_both_models_are_clipped_to_norm_10():
    """One batch of inputs scaled ×1000: each model moves by exactly lr·10 in its one SGD step."""
    entry, context = make_context("fml", num_classes=3, feature_dim=8, batch_size=4, lr=0.05)
    algorithm = entry.client(context)
    client = make_client(context, samples=4)
    client.train_x = client.train_x * 1000
    knowledge = entry.server(context).download()
    before = params.parameter_row(client.model)
    seed_global_torch(0, "train", 0, 0)
    result = algorithm.train(client, knowledge, 0, torch_generator(0, "batches", 0, 0))
    assert float((params.parameter_row(client.model) - before).norm()) == pytest.approx(0.5, rel=1e-3)
    assert float((result.upload["shared"] - knowledge["shared"]).norm()) == pytest.approx(0.5, rel=1e-3)


class _WithBatchNorm(nn.Module):
    def __init__(self, feature_dim):
        super().__init__()
        self.fc = nn.Linear(784, feature_dim)
        self.norm = nn.BatchNorm1d(feature_dim)

    def forward(self, x):
        return self.norm(self.fc(x.flatten(1)))


def test_g_buffers_restart_from_the_initial_g_every_round(monkeypatch):
    """HtFLlib's server never changes G's buffers, so every client's G_i starts from the initial ones."""
    def with_norm(*, num_classes, feature_dim, in_channels, image_size):
        return SplitModel(_WithBatchNorm(feature_dim), nn.Linear(feature_dim, num_classes), feature_dim)

    _register_for_the_test(monkeypatch, test_bn=with_norm)
    entry, context = make_context("fml", num_classes=3, feature_dim=8, batch_size=4, shared_model="test_bn")
    knowledge = entry.server(context).download()
    initial = {name: b.clone() for name, b in build_shared_model(context).named_buffers()}

    def train(algorithm, client_id):
        seed_global_torch(0, "train", client_id, 0)
        algorithm.train(make_client(context, client_id=client_id, samples=8, data_seed=client_id), knowledge, 0,
                        torch_generator(0, "batches", client_id, 0))
        return {name: b.clone() for name, b in algorithm.shared_copy.module.named_buffers()}

    reused = entry.client(context)
    after_first = train(reused, 0)
    key = "feature_extractor.norm.running_mean"
    assert not torch.equal(after_first[key], initial[key])  # training moved G_i's statistics
    after_second = train(reused, 1)
    fresh = train(entry.client(context), 1)
    for name in initial:
        assert torch.equal(after_second[name], fresh[name]), name  # client 1 did not inherit client 0's
    for name, buffer in reused.shared_copy.load(knowledge, torch.device("cpu")).named_buffers():
        assert torch.equal(buffer, initial[name]), name


@pytest.mark.integration
def test_real_run(single_run):
    rows = launch_smoke(single_run, "fml")
    assert all(r["test_acc"] == r["test_acc_head"] for r in rows)  # inference is M_i's own argmax
    assert all(r["shared_uploads"] == 6 for r in rows)


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_alpha_and_beta_bounds_are_inclusive_and_the_message_exact():
    entry = get_algorithm("fml")
    for value in (0.0, 1.0):
        parse_options(entry, {"alpha": value, "beta": value})
    with pytest.raises(ConfigError) as info:
        parse_options(entry, {"alpha": 1.5})
    assert str(info.value) == "config key 'algo.alpha' must be in [0, 1], got 1.5"


def test_shared_model_names_are_checked_with_exact_messages():
    entry = get_algorithm("fml")
    from htfl_dist.models import architectures, heads

    cases = {
        "HtCNN8": "config key 'algo.shared_model' is 'HtCNN8', a model group; name one architecture "
                  "(ARCH or ARCH:HEAD), e.g. htcnn2 or cnn:fc",
        "htcnn1,htcnn2": "config key 'algo.shared_model' is 'htcnn1,htcnn2', a model group; name one architecture "
                         "(ARCH or ARCH:HEAD), e.g. htcnn2 or cnn:fc",
        "bogus": "config key 'algo.shared_model' is 'bogus': unknown architecture 'bogus'; allowed: "
                 + ", ".join(architectures()) + " (optionally ARCH:HEAD)",
        "htcnn2:fc64": "config key 'algo.shared_model' is 'htcnn2:fc64': unknown head 'fc64'; allowed heads: "
                       + ", ".join(heads()),
    }
    assert all(f" {name}," in cases["bogus"] for name in ("cnn", "googlenet", "htcnn1"))
    assert "fc, fc128, " in cases["htcnn2:fc64"]
    for value, message in cases.items():
        with pytest.raises(ConfigError) as info:
            parse_options(entry, {"shared_model": value})
        assert str(info.value) == message, value


def test_shared_model_is_drawn_from_the_named_stream():
    """Module docstring: G is built from torch's RNG seeded by (seed, "shared-model")."""
    from htfl_dist.models import build_model

    _, context = make_context("fml", num_classes=10, feature_dim=16)
    seed_global_torch(0, "shared-model")
    expected = build_model("htcnn1", num_classes=10, feature_dim=16, in_channels=1, image_size=28)
    assert torch.equal(params.parameter_row(build_shared_model(context)), params.parameter_row(expected))


def test_fml_fields_by_hand():
    from htfl_dist.payload import Field

    for avg, extra in (("uniform", ()), ("sample_weighted", (Field("num_samples", torch.int64, max_rows=1),))):
        entry, context = make_context("fml", num_classes=10, feature_dim=16, avg=avg)
        shared = Field("shared", torch.float32, (params.parameter_count(build_shared_model(context)),), max_rows=1)
        assert entry.client.upload_fields(context) == (shared, *extra)
        assert entry.server.download_fields(context) == (shared,)


def test_upload_checks_accept_the_edges_and_name_what_is_wrong():
    server, _ = _server(avg="sample_weighted")
    width = server.row.shape[1]
    server.validate_upload(2, {"shared": torch.zeros(1, width), "num_samples": torch.tensor([1])})  # one count of 1
    with pytest.raises(ProtocolError) as info:
        server.validate_upload(2, {"shared": torch.zeros(2, width), "num_samples": torch.tensor([5])})
    assert str(info.value) == "client 2 sent 2 shared rows, expected 1"
    with pytest.raises(ProtocolError) as info:
        server.validate_upload(2, {"shared": torch.zeros(1, width), "num_samples": torch.tensor([3, 4])})
    assert str(info.value) == "client 2 sent num_samples=[3, 4], expected one count > 0"


def test_server_diagnostics_by_hand():
    """All-2.5 then a lone upload of all-4: G moves by 1.5 in each of its P entries, ‖·‖ = 1.5·√P."""
    server, _ = _server()
    width = server.row.shape[1]
    server.update({0: {"shared": torch.full((1, width), 2.5)}}, 0, torch_generator(0, "server", 0))
    got = server.update({1: {"shared": torch.full((1, width), 4.0)}}, 1, torch_generator(0, "server", 1))
    assert got == {"shared_uploads": 1, "shared_change": pytest.approx(1.5 * width ** 0.5, rel=1e-5)}


def _constant_logits(bias):
    """Features from a linear map of the image, a zero-weight head: logits = ``bias`` for every input."""
    head = nn.Linear(4, len(bias))
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.tensor(bias))
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(784, 4)), head, 4)


@pytest.mark.parametrize("kd,kl_scale", [("dml", 1.0), ("htfllib", 0.5)])
def test_mutual_objective_by_hand(monkeypatch, kd, kl_scale):
    """Local logits (0, 0): p = (1/2, 1/2); shared logits (ln 3, 0): p_g = (3/4, 1/4); labels 0, 1, 0, …
    One batch of 8, α = β = 1/2, so the first forward is the whole loss:
        CE(z) = ln 2; CE(z_g) = (ln(4/3) + ln 4)/2 (half the labels 0, half 1);
        KL(p_g‖p) = 3/4·ln(3/2) + 1/4·ln(1/2); KL(p‖p_g) = 1/2·ln(2/3) + 1/2·ln 2;
    dml averages KL over the batch (scale 1), htfllib over B·C = 2B (scale 1/2);
    loss_sum = 8 · (L + L_g)."""
    _register_for_the_test(monkeypatch, test_constant=lambda **_: _constant_logits([math.log(3.0), 0.0]))
    entry, context = make_context("fml", num_classes=2, feature_dim=4, batch_size=8, kd=kd,
                                  shared_model="test_constant")
    client = make_client(context, samples=8)
    client.model = _constant_logits([0.0, 0.0])
    client.optimizer = torch.optim.SGD(client.model.parameters(), lr=context.train.lr)
    seed_global_torch(0, "train", 0, 0)
    result = entry.client(context).train(client, entry.server(context).download(), 0,
                                         torch_generator(0, "batches", 0, 0))
    kl_local = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    kl_shared = 0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)
    local = 0.5 * math.log(2.0) + 0.5 * kl_scale * kl_local
    shared = 0.5 * (math.log(4 / 3) + math.log(4.0)) / 2 + 0.5 * kl_scale * kl_shared
    assert result.samples == 8
    assert result.loss_sum == pytest.approx(8 * (local + shared), rel=1e-5)


def test_average_rows_edges():
    """No rows: the exact message; a weight per row or ValueError; summed in float64 (1 + 1e-8 − 1
    keeps the 1e-8 in float64, loses it in float32), so the uniform mean is 1e-8/3."""
    with pytest.raises(ValueError) as info:
        params.average_rows([])
    assert str(info.value) == "average of no rows"
    with pytest.raises(ValueError):
        params.average_rows([torch.ones(1, 2), torch.ones(1, 2)], [1.0])
    rows = [torch.full((1, 2), value) for value in (1.0, 1e-8, -1.0)]
    assert torch.allclose(params.average_rows(rows), torch.full((1, 2), 1e-8 / 3), rtol=1e-5, atol=0.0)


def test_average_rows_is_the_float64_sum_in_row_order_in_every_chunk():
    """Rows longer than one chunk: each element is float32(((0 + x_0·w_0) + x_1·w_1) + ...) with
    w_i = n_i/Σn, every step in float64, as Python's floats compute it element by element (checked
    on both sides of every chunk boundary and at the ends)."""
    import numpy as np

    length = 2 * params._AVERAGE_CHUNK + 5
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, length, generator=generator) * scale for scale in (1.0, 1e-7, 3e4)]
    weights = [4.0, 4.0, 8.0]  # w = 1/4, 1/4, 1/2: exact
    boundary = params._AVERAGE_CHUNK
    for row, value in zip(rows, (4.0, -4.0, 2.0**-58), strict=True):  # in row order 1 - 1 + 2^-59 = 2^-59;
        row[0, boundary] = value                           # any other order loses the 2^-59
    mean = params.average_rows(rows, weights)
    assert mean[0, boundary].item() == 2.0**-59
    assert mean.shape == (1, length) and mean.dtype == torch.float32
    for index in (0, 1, params._AVERAGE_CHUNK - 1, params._AVERAGE_CHUNK, 2 * params._AVERAGE_CHUNK, length - 1):
        expected = 0.0
        for row, weight in zip(rows, weights, strict=True):
            expected = expected + float(row[0, index]) * (weight / sum(weights))
        assert mean[0, index].item() == float(np.float32(expected)), index


def test_identical_heads_check_describes_both_heads():
    """HtFE8-HtC4: client 0 is cnn:fc (Linear(4, 3)), client 1 googlenet:fc512 (Linear(4, 512),
    ReLU, Linear(512, 3)): the first mismatch is reported with both signatures."""
    from htfl_dist.algorithms.blocks.model_part import HEAD

    _, context = make_context("fml", num_classes=3, feature_dim=4, num_clients=4, group="HtFE8-HtC4")
    with pytest.raises(ConfigError) as info:
        HEAD.check(context, "LG-FedAvg")
    assert str(info.value) == (
        "LG-FedAvg shares the head, so all heads must be identical; client 1 (googlenet:fc512) has "
        "{0.weight:[512, 4], 0.bias:[512], 2.weight:[3, 512], 2.bias:[3]} but client 0 (cnn:fc) has "
        "{weight:[3, 4], bias:[3]}. Use a group with homogeneous heads, or feddistill/fml/fedkd/fedproto/fedtgp.")
