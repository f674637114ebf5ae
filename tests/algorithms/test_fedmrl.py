"""FedMRL: options, the fusion and the Matryoshka loss by hand, the small model G in both of its
shapes, the server's mean by hand, the client's round and inference, and one real run."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import launch_smoke, make_client, make_context, roundtrip
from torch import nn

from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.algorithms import parameters as params
from htfl_dist.algorithms.fedmrl import SMALL_MODEL, build_projector, fuse, matryoshka_loss
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.seeding import seed_global_torch, torch_generator

LN3, LN2 = math.log(3.0), math.log(2.0)


def linear(weight, bias=None) -> nn.Linear:
    weight = torch.tensor(weight, dtype=torch.float32)
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(torch.tensor(bias, dtype=torch.float32))
    return module


# --------------------------------------------------------------------------- options


def test_defaults_are_the_papers_and_compat_switches_the_reference_group():
    entry = get_algorithm("fedmrl")
    paper = parse_options(entry, {})
    assert (paper.avg, paper.projector, paper.eval_extractor, paper.small_rep) == \
        ("sample_weighted", "persistent", "local", "fc")
    assert (paper.rep_dim, paper.global_weight, paper.local_weight, paper.shared_model) == (128, 1.0, 1.0, None)
    reference = parse_options(entry, {"compat": "reference"})
    assert (reference.avg, reference.projector, reference.eval_extractor, reference.small_rep) == \
        ("uniform", "reset", "global", "pool")
    mixed = parse_options(entry, {"compat": "reference", "projector": "persistent", "avg": "sample_weighted"})
    assert (mixed.avg, mixed.projector, mixed.eval_extractor) == ("sample_weighted", "persistent", "global")


@pytest.mark.parametrize("options,message", [
    ({"rep_dim": 0}, "config key 'algo.rep_dim' must be >= 1, got 0"),
    ({"global_weight": -0.5}, "config key 'algo.global_weight' must be >= 0, got -0.5"),
    ({"local_weight": -1.0}, "config key 'algo.local_weight' must be >= 0, got -1.0"),
])
def test_bad_numbers_are_one_line_errors_naming_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        parse_options(get_algorithm("fedmrl"), options)
    assert str(info.value) == message


@pytest.mark.parametrize("key,value", [("projector", "frozen"), ("eval_extractor", "mixed"),
                                       ("small_rep", "slice"), ("avg", "median"), ("compat", "fedml"),
                                       ("shared_model", "HtCNN8")])
def test_bad_choices_name_their_key(key, value):
    with pytest.raises(ConfigError, match=rf"algo\.{key}") as info:
        parse_options(get_algorithm("fedmrl"), {key: value})
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- the maths by hand


def test_fusion_puts_gs_representation_first():
    """[R^G ; R^F] = [1, 2, 3]; P = [[1, 0, 0], [0, 1, 1]] + (0.5, 0) → (1.5, 5)."""
    projector = linear([[1, 0, 0], [0, 1, 1]], [0.5, 0.0])
    fused = fuse(torch.tensor([[1.0]]), torch.tensor([[2.0, 3.0]]), projector)
    assert torch.equal(fused, torch.tensor([[1.5, 5.0]]))


def test_matryoshka_loss_by_hand():
    """R̃ = (ln 3, ln 2), label 0, d1 = 1. G^hd(R̃[:1]) = (ln 3, 0): CE = ln(4/3); F^hd = identity on
    (ln 3, ln 2): CE = ln(5/3). m1 = 2, m2 = 0.5 → 2·ln(4/3) + 0.5·ln(5/3)."""
    fused = torch.tensor([[LN3, LN2]])
    small_head, local_head = linear([[1], [0]], [0, 0]), linear([[1, 0], [0, 1]], [0, 0])
    loss = matryoshka_loss(fused, torch.tensor([0]), small_head, local_head, 1, 2.0, 0.5)
    assert loss.item() == pytest.approx(2 * math.log(4 / 3) + 0.5 * math.log(5 / 3), rel=1e-6)
    # equal weights by default, and each CE is a batch mean: a second sample of label 1 with
    # R̃ = (0, 0) adds ln 2 to both terms: ((ln(4/3) + ln 2) + (ln(5/3) + ln 2)) / 2
    batch = torch.tensor([[LN3, LN2], [0.0, 0.0]])
    loss = matryoshka_loss(batch, torch.tensor([0, 1]), small_head, local_head, 1)
    assert loss.item() == pytest.approx((math.log(4 / 3) + math.log(5 / 3)) / 2 + LN2, rel=1e-6)


# --------------------------------------------------------------------------- the small model G


def _context(**options):
    options.setdefault("rep_dim", 8)
    return make_context("fedmrl", num_classes=3, feature_dim=16, **options)


def test_paper_g_is_client_0s_member_with_a_d1_wide_last_layer():
    """htcnn1 (conv5-32, fc) at d1 = 8 on 28×28, C = 3: conv 25·32 + 32 = 832, fc 4608·8 + 8 = 36872,
    head 8·3 + 3 = 27 → 37731 parameters, the same on the wire, identical wherever it is built."""
    _, context = _context()
    model = SMALL_MODEL.initial(context)
    assert model.features(torch.zeros(2, 1, 28, 28)).shape == (2, 8)
    assert params.parameter_count(model) == 37731 == SMALL_MODEL.floats(context)
    before = torch.random.get_rng_state()
    again = SMALL_MODEL.initial(context)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(params.parameter_row(model), params.parameter_row(again))


def test_htfllib_g_pools_the_k_wide_features_down_to_d1():
    """HtFLlib's BaseHeadSplit: the member at K = 16 (fc 4608·16 + 16 = 73744), AdaptiveAvgPool1d(8)
    averages neighbouring pairs, and a Linear(8, 3) header (27): 832 + 73744 + 27 = 74603."""
    _, context = _context(small_rep="pool")
    model = SMALL_MODEL.initial(context)
    assert params.parameter_count(model) == 74603 == SMALL_MODEL.floats(context)
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    wide = model.feature_extractor[0](x)
    assert wide.shape == (3, 16)
    torch.testing.assert_close(model.features(x), (wide[:, 0::2] + wide[:, 1::2]) / 2)
    assert torch.equal(params.parameter_row(model), params.parameter_row(SMALL_MODEL.initial(context)))


def test_htfllib_initial_weights_draw_g_right_after_seeding_with_the_run_seed():
    """HtFLlib's server builds G first thing after torch.manual_seed(0): the K-wide member (its own
    Linear(K, C) included, then discarded) and then the Linear(d1, C) header. So G's extractor is
    client 0's initial extractor under model.init=htfllib, and its header the next draw."""
    from dataclasses import replace

    from htfl_dist.models import build_model, initial_client_model

    _, context = _context(small_rep="pool")
    alike = replace(context, model_init="htfllib")
    small = SMALL_MODEL.initial(alike)
    client0 = initial_client_model(alike.model_group, 0, 0, num_classes=3, feature_dim=16, in_channels=1,
                                   image_size=28, init="htfllib")
    extractor = small.feature_extractor[0]
    assert torch.equal(params.parameter_row(extractor), params.parameter_row(client0.feature_extractor))
    torch.manual_seed(0)
    build_model("htcnn1", num_classes=3, feature_dim=16, in_channels=1, image_size=28)
    assert torch.equal(small.head.weight, nn.Linear(8, 3).weight)
    assert not torch.equal(params.parameter_row(small), params.parameter_row(SMALL_MODEL.initial(context)))


def test_d1_above_k_is_refused_at_start_up():
    _, context = _context(rep_dim=17)
    with pytest.raises(ConfigError) as info:
        get_algorithm("fedmrl").client.check_models(context)
    assert str(info.value).startswith("config key 'algo.rep_dim' is 17, above model.feature_dim=16")
    _, fits = _context(rep_dim=16)
    get_algorithm("fedmrl").client.check_models(fits)


def test_projector_is_per_client_or_alike_under_htfllib_initial_weights():
    from dataclasses import replace

    _, context = _context()
    seed_global_torch(0, "algorithm-init", 0)
    first = build_projector(context)
    seed_global_torch(0, "algorithm-init", 1)
    second = build_projector(context)
    assert (first.in_features, first.out_features) == (24, 16)  # d1 + K → K
    assert not torch.equal(first.weight, second.weight)
    alike = replace(context, model_init="htfllib")
    torch.manual_seed(0)
    expected = nn.Linear(24, 16)  # HtFLlib: torch.manual_seed(0), then nn.Linear
    seed_global_torch(0, "algorithm-init", 5)
    assert torch.equal(build_projector(alike).weight, expected.weight)


# --------------------------------------------------------------------------- server


def _server(**options):
    entry, context = _context(**options)
    return entry.server(context), context


def test_server_starts_from_the_clients_initial_g():
    server, context = _server()
    assert torch.equal(server.download()["small_model"], params.parameter_row(SMALL_MODEL.initial(context)))
    assert server.theory_download_floats() == 37731


def test_sample_weighted_mean_by_hand():
    """The paper's Σ n_k/n·G_k: (1·1 + 3·4)/4 = 3.25."""
    server, _ = _server()
    width = server.row.shape[1]
    uploads = {3: {"small_model": torch.full((1, width), 4.0), "num_samples": torch.tensor([3])},
               0: {"small_model": torch.full((1, width), 1.0), "num_samples": torch.tensor([1])}}
    for client_id, upload in uploads.items():
        server.validate_upload(client_id, upload)
    diagnostics = server.update(uploads, 0, torch_generator(0, "server", 0))
    assert torch.allclose(server.download()["small_model"], torch.full((1, width), 3.25))
    assert diagnostics["small_model_uploads"] == 2


def test_uniform_mean_by_hand_under_htfllib():
    server, _ = _server(compat="reference")
    width = server.row.shape[1]
    uploads = {0: {"small_model": torch.full((1, width), 1.0)}, 1: {"small_model": torch.full((1, width), 4.0)}}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    assert torch.allclose(server.download()["small_model"], torch.full((1, width), 2.5))


def test_bad_uploads_are_refused_and_state_round_trips():
    server, context = _server()
    width = server.row.shape[1]
    before = server.download()["small_model"].clone()
    assert torch.equal(server.download()["small_model"], before)
    with pytest.raises(ProtocolError, match="num_samples"):
        server.validate_upload(2, {"small_model": torch.zeros(1, width), "num_samples": torch.tensor([0])})
    server.update({1: {"small_model": torch.full((1, width), 7.0), "num_samples": torch.tensor([2])}}, 0,
                  torch_generator(0, "server", 0))
    fresh = get_algorithm("fedmrl").server(context)
    fresh.load_state_dict(roundtrip(server.state_dict()))
    assert torch.equal(fresh.download()["small_model"], server.download()["small_model"])


# --------------------------------------------------------------------------- client


def _trained(**options):
    entry, context = _context(**options)
    algorithm = entry.client(context)
    client = make_client(context, samples=9)
    seed_global_torch(0, "algorithm-init", 0)
    algorithm.init_client(client)
    knowledge = {name: tensor.clone() for name, tensor in entry.server(context).download().items()}
    return entry, context, algorithm, client, knowledge


def _train(algorithm, client, knowledge, round_index=0):
    seed_global_torch(0, "train", client.client_id, round_index)
    return algorithm.train(client, knowledge, round_index, torch_generator(0, "batches", client.client_id, round_index))


def test_paper_client_trains_f_g_and_p_keeps_p_and_its_own_g():
    _, _, algorithm, client, knowledge = _trained()
    download = knowledge["small_model"].clone()
    model_before = params.parameter_row(client.model)
    projector_before = params.parameter_row(client.modules["projector"])
    result = _train(algorithm, client, knowledge)
    assert torch.equal(knowledge["small_model"], download)  # the shared download is not modified
    assert not torch.equal(params.parameter_row(client.model), model_before)
    assert not torch.equal(params.parameter_row(client.modules["projector"]), projector_before)
    assert not torch.equal(result.upload["small_model"], download)
    assert torch.equal(result.upload["small_model"], params.parameter_row(client.modules["small_model"]))
    assert result.upload["num_samples"].tolist() == [9]
    assert algorithm.theory_upload_floats(client) == download.shape[1] == 37731
    assert sorted(client.modules) == ["projector", "small_model"]
    for name, module in client.modules.items():  # checkpointed by client id
        assert all(torch.equal(a, b) for a, b in zip(roundtrip(module.state_dict()).values(),
                                                     module.state_dict().values(), strict=True)), name


def test_reset_projector_trains_a_copy_and_keeps_the_initial_one():
    _, _, algorithm, client, knowledge = _trained(compat="reference")
    initial = params.parameter_row(client.modules["projector"])
    result = _train(algorithm, client, knowledge)
    assert torch.equal(params.parameter_row(client.modules["projector"]), initial)
    assert sorted(client.modules) == ["projector"] and "num_samples" not in result.upload
    # the same client trained again from the same download repeats its round exactly
    client_again = make_client(algorithm.context, samples=9)
    client_again.modules["projector"] = client.modules["projector"]
    assert torch.equal(_train(algorithm, client_again, knowledge).upload["small_model"],
                       result.upload["small_model"])


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 0.5)])
def test_the_round_minimises_the_weighted_sum_of_both_heads_ces(weights):
    """Headers with zero weights: G's gives (ln 3, 0) and the client's (0, 0) whatever R̃ is; labels
    0, 1, 0, ... on one batch of 8: CE(ŷ^G) = (ln(4/3) + ln 4)/2, CE(ŷ^F) = ln 2, and the loss_sum
    of the round is 8·(m1·CE_G + m2·CE_F)."""
    m1, m2 = weights
    entry, context = make_context("fedmrl", num_classes=2, feature_dim=4, batch_size=8, rep_dim=2,
                                  global_weight=m1, local_weight=m2)
    small = SMALL_MODEL.initial(context)
    client = make_client(context, samples=8)
    with torch.no_grad():
        for head, bias in ((small.head, [LN3, 0.0]), (client.model.head, [0.0, 0.0])):
            head.weight.zero_()
            head.bias.copy_(torch.tensor(bias))
    algorithm = entry.client(context)
    algorithm.init_client(client)
    result = _train(algorithm, client, {"small_model": params.parameter_row(small)})
    expected = m1 * (math.log(4 / 3) + math.log(4.0)) / 2 + m2 * LN2
    assert result.samples == 8
    assert result.loss_sum == pytest.approx(8 * expected, rel=1e-5)


# --------------------------------------------------------------------------- inference


def _evaluate(algorithm, client, knowledge, x):
    algorithm.prepare_evaluation(client, knowledge)
    client.model.eval()
    with torch.no_grad():
        features, logits = client.model.forward_with_features(x)
        return algorithm.predict(client, knowledge, features, logits, x), logits.argmax(dim=1)


def test_inference_is_the_local_header_on_the_fused_representation():
    """A projector with zero weights and bias e_2 makes R̃ = e_2 for every input; with the client's
    header the identity on its first 3 of K dimensions, every prediction is class 2, whatever the
    client's own head says about its raw features."""
    _, _, algorithm, client, knowledge = _trained()
    projector = client.modules["projector"]
    with torch.no_grad():
        projector.weight.zero_()
        projector.bias.zero_()
        projector.bias[2] = 1.0
        client.model.head.weight.zero_()
        client.model.head.bias.zero_()
        client.model.head.weight[:, :3] = torch.eye(3)
    predicted, _ = _evaluate(algorithm, client, knowledge, client.test_x)
    assert predicted.tolist() == [2] * client.test_x.shape[0]


def test_inference_fuses_the_clients_own_g_or_the_downloaded_one():
    """P passes G's first representation dimension to R̃'s dimension c and nothing else; the header
    reads R̃'s first 3 dimensions. G^ex's first output then decides: the client's own G (local)
    or the download's (global), which we make differ by G's last extractor bias."""
    for mode in ("local", "global"):
        _, context, algorithm, client, _ = _trained(eval_extractor=mode)
        small = SMALL_MODEL.initial(context)
        fc = small.feature_extractor[-2]  # the last Linear before its ReLU: R^G = ReLU(fc(·))
        with torch.no_grad():
            fc.weight.zero_()
            fc.bias.zero_()
        zero_rep = params.parameter_row(small)
        with torch.no_grad():
            fc.bias[0] = 1.0
        one_rep = params.parameter_row(small)
        projector = client.modules["projector"]
        with torch.no_grad():
            projector.weight.zero_()
            projector.bias.zero_()
            projector.bias[0] = 0.5  # R̃ = (0.5, R^G_0, 0, ...)
            projector.weight[1, 0] = 1.0
            client.model.head.weight.zero_()
            client.model.head.bias.zero_()
            client.model.head.weight[:, :3] = torch.eye(3)
        own_rep = one_rep if mode == "local" else zero_rep
        knowledge_rep = zero_rep if mode == "local" else one_rep
        if mode == "local":
            params.load_parameter_row(client.modules["small_model"], own_rep)
        predicted, _ = _evaluate(algorithm, client, {"small_model": knowledge_rep}, client.test_x)
        # R^G_0 = 1 → R̃ = (0.5, 1, 0) → class 1; R^G_0 = 0 would give class 0
        assert predicted.tolist() == [1] * client.test_x.shape[0], mode


def test_predict_needs_the_batch_inputs_after_prepare_evaluation():
    _, _, algorithm, client, knowledge = _trained()
    features, logits = client.model.forward_with_features(client.test_x)
    with pytest.raises(ValueError, match="inputs, after prepare_evaluation"):
        algorithm.predict(client, knowledge, features, logits, client.test_x)
    algorithm.prepare_evaluation(client, knowledge)
    with pytest.raises(ValueError, match="inputs, after prepare_evaluation"):
        algorithm.predict(client, knowledge, features, logits)

@pytest.mark.integration
def test_real_run(single_run):
    rows = launch_smoke(single_run, "fedmrl")
    assert all(r["small_model_uploads"] == 6 for r in rows)
    assert all(r["bytes_theory_up"] == 6 * 4 * 592074 for r in rows)  # htcnn1 at d1 = 128: |G| floats each
