"""FedGen: the generator's shape and size (Θ), the label prior from the setup upload, the
client's generator term (h_i only, its own label stream), the server's generator step by hand,
persist_generator=false, options, one real run."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import head_row, head_upload, launch_smoke, make_client, make_context
from reference_starts import fedgen_generator

from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.algorithms.fedgen import FedGenGenerator, draw_labels_and_noise, generator_size
from htfl_dist.algorithms.training import Batch
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.seeding import torch_generator


def _counts(values):
    return {"label_counts": torch.tensor([values])}


@pytest.mark.parametrize("num_classes,theta", [(100, 331_776), (10, 285_696)])
def test_generator_size_matches_the_spec(num_classes, theta):
    assert generator_size(32, num_classes, 512, 512) == theta
    module = FedGenGenerator(32, num_classes, 512, 512)
    assert sum(p.numel() for p in module.parameters()) == theta
    assert [name for name, _ in module.named_parameters()] == [
        "fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    assert tuple(module.fc1.weight.shape) == (512, 32 + num_classes)
    out = module(torch.tensor([0, 1, 2]), torch.rand(3, 32))
    assert out.shape == (3, 512)


def test_prior_from_setup_counts_and_download():
    entry, context = make_context("fedgen")
    server = entry.server(context)
    server.validate_setup_upload(0, _counts([2, 0, 1]))
    server.setup({1: _counts([1, 3, 0]), 0: _counts([2, 0, 1])})
    download = server.download()
    assert download["label_counts"].tolist() == [[3, 3, 1]]
    assert set(download) == {"head", "generator", "label_counts"}
    # K·C + C + Θ with nd = 32, hd = K = 4: (32+3)·4 + 12 + 16 + 4 = 172
    assert download["generator"].shape == (1, 172)
    assert server.theory_download_floats() == 15 + 172
    with pytest.raises(ProtocolError):
        server.validate_setup_upload(0, _counts([0, 0, 0]))
    with pytest.raises(ProtocolError):
        server.validate_setup_upload(0, _counts([2, -1, 0]))


def test_client_setup_upload_counts_labels():
    entry, context = make_context("fedgen")
    client = make_client(context, 0, samples=7)  # labels 0,1,2,0,1,2,0
    assert entry.client(context).setup_upload(client)["label_counts"].tolist() == [[3, 2, 2]]


def test_labels_follow_the_prior_and_the_stream():
    labels, noise = draw_labels_and_noise(torch.tensor([0, 5, 0]), 50, 8, "uniform", torch_generator(0, "x"))
    assert labels.tolist() == [1] * 50
    assert noise.shape == (50, 8) and float(noise.min()) >= 0.0 and float(noise.max()) < 1.0
    _, gaussian = draw_labels_and_noise(torch.tensor([1, 1, 1]), 200, 8, "gaussian", torch_generator(0, "x"))
    assert float(gaussian.min()) < 0.0
    again, _ = draw_labels_and_noise(torch.tensor([1, 1, 1]), 20, 8, "uniform", torch_generator(0, "y"))
    same, _ = draw_labels_and_noise(torch.tensor([1, 1, 1]), 20, 8, "uniform", torch_generator(0, "y"))
    assert torch.equal(again, same)


def _knowledge(entry, context):
    server = entry.server(context)
    server.setup({0: _counts([3, 3, 3])})
    return server.download()


def test_client_term_reaches_the_head_only_and_uses_its_own_stream():
    entry, context = make_context("fedgen")
    algorithm = entry.client(context)
    client = make_client(context, 1)
    knowledge = _knowledge(entry, context)
    x, y = client.train_x[:4], client.train_y[:4]
    state = torch.get_rng_state()
    loss_fn = algorithm.loss_function(client, knowledge, 0)
    features, logits = client.model.forward_with_features(x)
    term = loss_fn(Batch(x, y, features, logits)) - F.cross_entropy(logits, y)
    assert torch.equal(torch.get_rng_state(), state)  # ŷ and ε come from the dedicated stream
    client.model.zero_grad(set_to_none=True)
    term.backward()
    assert all(p.grad is None or not p.grad.any() for p in client.model.feature_extractor.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in client.model.head.parameters())
    assert all(p.grad is None for p in algorithm.generator.parameters())
    # the same (client, round) draws the same labels and noise; another round does not
    again = algorithm.loss_function(client, knowledge, 0)(Batch(x, y, features.detach(), logits.detach()))
    other = algorithm.loss_function(client, knowledge, 1)(Batch(x, y, features.detach(), logits.detach()))
    torch.testing.assert_close(again, term.detach() + F.cross_entropy(logits.detach(), y))
    assert not torch.allclose(again, other)
    # by hand: the term is CE(h_i(G(ŷ, ε)), ŷ) with G in train mode (batch statistics) and ŷ, ε from
    # the stream (seed, "fedgen-labels", client, round), B = the client batch size (4)
    labels, noise = draw_labels_and_noise(knowledge["label_counts"][0], 4, 32, "uniform",
                                          torch_generator(0, "fedgen-labels", 1, 0))
    reference = copy.deepcopy(algorithm.generator).train()
    with torch.no_grad():
        expected = F.cross_entropy(client.model.head(reference(labels, noise)), labels)
    torch.testing.assert_close(term.detach(), expected)


def test_client_loads_the_downloaded_generator_and_head():
    entry, context = make_context("fedgen", lr=0.0)
    algorithm = entry.client(context)
    client = make_client(context, 1)
    knowledge = _knowledge(entry, context)
    knowledge["generator"] = torch.full_like(knowledge["generator"], 0.01)
    result = algorithm.train(client, knowledge, 0, torch_generator(0, "batches", 1, 0))
    torch.testing.assert_close(head_row(algorithm.generator), knowledge["generator"])
    torch.testing.assert_close(result.upload["head"], knowledge["head"])  # lr 0: the swapped-in head
    assert torch.equal(knowledge["generator"], torch.full_like(knowledge["generator"], 0.01))  # not aliased


def _server_with_prior(**options):
    entry, context = make_context("fedgen", feature_dim=2, num_classes=2, batch_size=4, **options)
    server = entry.server(context)
    server.setup({0: _counts([1, 1])})
    return entry, context, server


@pytest.mark.parametrize("head_avg,averaged", [
    ("sample_weighted", [0.75, 0.5, -0.5, -0.75, 0.375, 0.0]),
    ("uniform", [0.5, 1.0, -1.0, -0.5, 0.25, 0.0]),  # G still learns from the sample-weighted ensemble
])
def test_server_generator_step_by_hand(head_avg, averaged):
    """One step: Adam on CE(¼·h_0(G) + ¾·h_2(G), ŷ) with the uploaded (not averaged) heads."""
    _, _, server = _server_with_prior(server_steps=1, server_lr=0.1, head_avg=head_avg)
    uploads = {2: head_upload([1, 0, 0, -1, 0.5, 0], 3), 0: head_upload([0, 2, -2, 0, 0, 0], 1)}
    generator_before = copy.deepcopy(server.generator)
    diagnostics = server.update(uploads, 0, torch_generator(0, "server", 0))

    labels, noise = draw_labels_and_noise(torch.tensor([1, 1]), 4, 32, "uniform", torch_generator(0, "server", 0))
    z = generator_before(labels, noise)
    w0, b0 = torch.tensor([[0.0, 2.0], [-2.0, 0.0]]), torch.tensor([0.0, 0.0])
    w2, b2 = torch.tensor([[1.0, 0.0], [0.0, -1.0]]), torch.tensor([0.5, 0.0])
    logits = 0.25 * (z @ w0.t() + b0) + 0.75 * (z @ w2.t() + b2)
    loss = F.cross_entropy(logits, labels)
    optimizer = torch.optim.Adam(generator_before.parameters(), lr=0.1)
    loss.backward()
    optimizer.step()
    assert diagnostics["generator_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    torch.testing.assert_close(head_row(server.generator), head_row(generator_before))
    # then the heads are averaged as in LG-FedAvg
    torch.testing.assert_close(server.download()["head"], torch.tensor([averaged]))


def test_generator_loss_falls_over_rounds_and_state_round_trips():
    entry, context, server = _server_with_prior(server_steps=30)
    uploads = {0: head_upload([3, 0, -3, 0, 0, 0], 5), 1: head_upload([2, 1, -2, -1, 0, 0], 5)}
    first = server.update(uploads, 0, torch_generator(0, "server", 0))["generator_loss"]
    second = server.update(uploads, 1, torch_generator(0, "server", 1))["generator_loss"]
    assert second < first
    steps = [int(state["step"]) for state in server.optimizer.state.values()]
    assert steps == [60] * 6  # one Adam kept across the two rounds (generator_optimizer: persistent)
    buffer = io.BytesIO()
    torch.save(server.state_dict(), buffer)
    buffer.seek(0)
    fresh = entry.server(context)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for key, value in server.download().items():
        assert torch.equal(fresh.download()[key], value), key
    # the Adam state came back too: the next round matches
    a = server.update(uploads, 2, torch_generator(0, "server", 2))["generator_loss"]
    b = fresh.update(uploads, 2, torch_generator(0, "server", 2))["generator_loss"]
    assert a == b


def test_persist_generator_false_keeps_the_initial_generator():
    entry, context, server = _server_with_prior(persist_generator=False)
    client_generator = entry.client(context).generator
    before = head_row(server.generator)
    assert torch.equal(before, head_row(client_generator))  # both sides build the same initial G
    diagnostics = server.update({0: head_upload([1, 2, 3, 4, 5, 6], 2)}, 0, torch_generator(0, "server", 0))
    assert "generator_loss" not in diagnostics
    assert torch.equal(head_row(server.generator), before)
    assert set(server.download()) == {"head", "label_counts"}
    assert server.theory_download_floats() == 6
    assert {f.name for f in entry.server.download_fields(context)} == {"head", "label_counts"}


def test_compat_reference_and_bad_options():
    entry = get_algorithm("fedgen")
    paper = parse_options(entry, {})
    assert (paper.persist_generator, paper.generator_optimizer, paper.noise_dim, paper.server_lr,
            paper.server_steps, paper.noise) == (True, "persistent", 32, 0.1, 100, "uniform")
    reference = parse_options(entry, {"compat": "reference"})
    assert (reference.persist_generator, reference.generator_optimizer) == (False, "per_round")
    assert parse_options(entry, {"compat": "reference", "persist_generator": True}).persist_generator is True
    for options, key in (({"noise": "laplace"}, "algo.noise"), ({"server_lr": -1}, "algo.server_lr"),
                         ({"server_steps": 0}, "algo.server_steps"), ({"noise_dim": 0}, "algo.noise_dim"),
                         ({"hidden_dim": 0}, "algo.hidden_dim"),
                         ({"generator_optimizer": "sgd"}, "algo.generator_optimizer")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_options(entry, options)


def test_heterogeneous_heads_and_batches_of_one_are_refused():
    entry, context = make_context("fedgen", group="htcnn1:fc,htcnn2:fc512")
    with pytest.raises(ConfigError, match="FedGen shares the head"):
        entry.client.check_models(context)
    entry, context = make_context("fedgen", batch_size=1)
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        entry.client.check_models(context)


@pytest.mark.integration
@pytest.mark.parametrize("overrides,persist", [((), True), (("algo.persist_generator=false",), False)])
def test_real_run(single_run, overrides, persist):
    """The paper's default persists G (the conformance test's run, shared); HtFLlib's quirk does not."""
    rows = launch_smoke(single_run, "fedgen", *overrides)
    assert rows[0]["bytes_setup_up"] > 0
    assert all(("generator_loss" in r) == persist for r in rows)


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_declared_fields_prior_head_and_generator():
    from htfl_dist.payload import Field

    entry, context = make_context("fedgen")  # C = 3, K = 4, nd = 32, hd = K
    prior = Field("label_counts", torch.int64, (3,), max_rows=1)
    head = Field("head", torch.float32, (15,), max_rows=1)
    assert entry.client.setup_upload_fields(context) == (prior,)
    # Θ = (32+3)·4 + 3·4 + 4·4 + 4 = 172
    assert entry.server.download_fields(context) == (head, Field("generator", torch.float32, (172,), max_rows=1), prior)
    entry, context = make_context("fedgen", hidden_dim=6)  # (32+3)·6 + 3·6 + 6·4 + 4 = 256
    assert entry.server.download_fields(context)[1] == Field("generator", torch.float32, (256,), max_rows=1)
    assert entry.server(context).download()["generator"].shape == (1, 256)


def test_initial_generator_comes_from_its_own_named_stream_and_is_frozen_on_clients():
    from htfl_dist.seeding import derive_seed

    entry, context = make_context("fedgen")
    torch.manual_seed(derive_seed(0, "fedgen-generator"))  # the stream the module docstring names
    expected = FedGenGenerator(32, 3, 4, 4)
    torch.manual_seed(99)
    server, client_side = entry.server(context), entry.client(context)
    for module in (server.generator, client_side.generator):
        torch.testing.assert_close(head_row(module), head_row(expected), rtol=0, atol=0)
    assert not any(p.requires_grad for p in client_side.generator.parameters())


def test_htfllib_init_draws_the_generator_as_htfllib_does():
    """model.init=htfllib: the initial G (server's and clients' alike) is HtFLlib's first draws
    after the last clientGen's torch.manual_seed(0) and its one DataLoader pass (the run seed
    standing for 0); the global RNG is left alone; other inits keep the named stream."""
    import dataclasses

    entry, context = make_context("fedgen")  # C = 3, K = 4, nd = 32, hd = K
    context = dataclasses.replace(context, seed=4, model_init="htfllib")
    expected = fedgen_generator(4, 32, 3, 4, 4)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    server, client_side = entry.server(context), entry.client(context)
    assert torch.equal(torch.get_rng_state(), before)
    for module in (server.generator, client_side.generator):
        got = [module.fc1.weight, module.fc1.bias, module.fc.weight, module.fc.bias]
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine.detach(), theirs, rtol=0, atol=0)
    named = entry.server(dataclasses.replace(context, model_init="per_client")).generator
    assert not torch.equal(named.fc1.weight, expected[0])


def test_all_zero_prior_falls_back_to_uniform_and_a_single_label_prior_is_kept():
    labels, _ = draw_labels_and_noise(torch.tensor([0, 0, 0]), 300, 2, "uniform", torch_generator(0, "x"))
    assert sorted(set(labels.tolist())) == [0, 1, 2]
    labels, _ = draw_labels_and_noise(torch.tensor([0, 1, 0]), 50, 2, "uniform", torch_generator(0, "x"))
    assert labels.tolist() == [1] * 50  # Σ = 1 is a real prior, not "no prior"


def test_batches_of_two_are_accepted_and_one_is_an_exact_message():
    entry, context = make_context("fedgen", batch_size=2)
    entry.client.check_models(context)
    entry, context = make_context("fedgen", batch_size=1)
    with pytest.raises(ConfigError) as info:
        entry.client.check_models(context)
    assert str(info.value) == ("FedGen's generator has BatchNorm in train mode, which needs batches of at least "
                               "2 generated samples; config key 'train.batch_size' is 1")


def test_setup_upload_counts_every_class_even_absent_ones():
    entry, context = make_context("fedgen")
    client = make_client(context, 0, samples=4)
    client.train_y = torch.tensor([0, 1, 0, 1])  # class 2 (the last) is absent
    assert entry.client(context).setup_upload(client)["label_counts"].tolist() == [[2, 2, 0]]


def test_prior_is_int64_before_and_after_setup_and_setup_checks_have_one_message():
    entry, context = make_context("fedgen")
    server = entry.server(context)
    before = server.download()["label_counts"]
    assert before.dtype == torch.int64 and before.tolist() == [[0, 0, 0]]
    server.validate_setup_upload(0, _counts([0, 1, 0]))  # one sample is enough
    server.setup({0: _counts([0, 1, 0]), 1: _counts([2, 0, 0])})
    after = server.download()["label_counts"]
    assert after.dtype == torch.int64 and after.tolist() == [[2, 1, 0]]
    for bad in (_counts([0, 0, 0]), {"label_counts": torch.tensor([[1, 0, 0], [1, 0, 0]])}):
        with pytest.raises(ProtocolError) as info:
            server.validate_setup_upload(4, bad)
        assert str(info.value) == "client 4 sent invalid label counts (expected one row, >= 0, sum > 0)"


def test_checkpointed_label_counts_come_back_as_int64():
    entry, context, server = _server_with_prior()
    state = server.state_dict()
    state["label_counts"] = state["label_counts"].double()
    fresh = entry.server(context)
    fresh.load_state_dict(state)
    assert fresh.download()["label_counts"].dtype == torch.int64


def test_per_round_optimizer_is_fresh_every_round_and_not_checkpointed():
    _, _, server = _server_with_prior(server_steps=3, generator_optimizer="per_round")
    uploads = {0: head_upload([3, 0, -3, 0, 0, 0], 5)}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    server.update(uploads, 1, torch_generator(0, "server", 1))
    assert [int(state["step"]) for state in server.optimizer.state.values()] == [3] * 6  # not 6
    assert "optimizer" not in server.state_dict()
    _, _, persistent = _server_with_prior(server_steps=3)
    assert "optimizer" not in persistent.state_dict()  # no optimizer yet: nothing to save
    persistent.update(uploads, 0, torch_generator(0, "server", 0))
    assert "optimizer" in persistent.state_dict()


def test_generator_loss_is_the_mean_over_the_steps():
    """Two Adam steps replayed by hand on one uploaded head (weight 1): the reported loss is
    (loss_1 + loss_2)/2, each step drawing its ŷ, ε next from the round's stream."""
    _, _, server = _server_with_prior(server_steps=2, server_lr=0.1)
    reference = copy.deepcopy(server.generator)
    diagnostics = server.update({0: head_upload([1, 0, 0, -1, 0.5, 0], 3)}, 0,
                                torch_generator(0, "server", 0))
    stream = torch_generator(0, "server", 0)
    weight, bias = torch.tensor([[1.0, 0.0], [0.0, -1.0]]), torch.tensor([0.5, 0.0])
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        labels, noise = draw_labels_and_noise(torch.tensor([1, 1]), 4, 32, "uniform", stream)
        loss = F.cross_entropy(reference(labels, noise) @ weight.t() + bias, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[0] != losses[1]
    assert diagnostics["generator_loss"] == pytest.approx((losses[0] + losses[1]) / 2, rel=1e-5)
    torch.testing.assert_close(head_row(server.generator), head_row(reference))


def test_training_uses_the_rounds_own_label_stream():
    """Two identical clients, the same batches, rounds 0 and 1: the generated labels differ, so the
    trained heads differ."""
    entry, context = make_context("fedgen")
    algorithm = entry.client(context)
    knowledge = _knowledge(entry, context)
    heads = [algorithm.train(make_client(context, 1), knowledge, round_index,
                             torch_generator(0, "batches", 1, 0)).upload["head"] for round_index in (0, 1)]
    assert not torch.allclose(heads[0], heads[1])
