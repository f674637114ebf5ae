"""FedGH: the server's head step on (prototype, class) pairs against a hand-computed SGD step, the
persistent head, post-update prototypes, the identical-heads check, options, one real run."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import head_row, launch_smoke, make_client, make_context

from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.seeding import torch_generator


def _server(**options):
    entry, context = make_context("fedgh", feature_dim=2, num_classes=2, **options)
    return entry.server(context)


def _pairs():
    # client 0: class 0 at (1, 0), class 1 at (0, 2); client 1: class 0 at (2, 2)
    return {0: {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[1.0, 0.0], [0.0, 2.0]])},
            1: {"class_ids": torch.tensor([0]), "protos": torch.tensor([[2.0, 2.0]])}}


def _zero_head(server):
    server.load_state_dict({"head": torch.zeros(1, 6)})


def test_one_server_epoch_is_one_sgd_step_by_hand():
    server = _server(server_lr=0.3, server_batch_size=3)  # the 3 pairs in one batch: one step
    _zero_head(server)
    diagnostics = server.update(_pairs(), 0, torch_generator(0, "server", 0))
    # H = 0: softmax = (1/2, 1/2); s − onehot = (−½, ½) for class 0, (½, −½) for class 1
    # dW row 0 = (1/3)[−½·(1,0) + ½·(0,2) − ½·(2,2)] = (−½, 0); row 1 = (½, 0)
    # db = (1/3)(−½ + ½ − ½, ½ − ½ + ½) = (−1/6, 1/6);   H' = −0.3·grad
    expected = torch.tensor([[0.15, 0.0, -0.15, 0.0, 0.05, -0.05]])
    torch.testing.assert_close(server.download()["head"], expected)
    assert diagnostics["server_pairs"] == 3
    assert diagnostics["server_loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)


def test_client_batch_size_gives_two_steps_and_the_head_persists():
    entry, context = make_context("fedgh", feature_dim=2, num_classes=2, batch_size=2, server_lr=0.3)
    server = entry.server(context)
    _zero_head(server)
    server.update(_pairs(), 0, torch_generator(0, "server", 0))  # batches of 2 and 1: two SGD steps
    after_one = server.download()["head"].clone()
    one_step = torch.tensor([[0.15, 0.0, -0.15, 0.0, 0.05, -0.05]])
    assert not torch.allclose(after_one, one_step)  # two steps differ from one full-batch step
    server.update(_pairs(), 1, torch_generator(0, "server", 1))
    second = server.download()["head"]
    assert not torch.equal(second, after_one)
    # persistent: round 2 trains on from round 1's head (a fresh zero head gives another result)
    restart = entry.server(context)
    _zero_head(restart)
    restart.update(_pairs(), 1, torch_generator(0, "server", 1))
    assert not torch.allclose(restart.download()["head"], second)


def test_more_epochs_lower_the_loss_more():
    losses = {}
    for epochs in (1, 20):
        server = _server(server_epochs=epochs, server_lr=0.3)
        _zero_head(server)
        server.update(_pairs(), 0, torch_generator(0, "server", 0))
        head = server.download()["head"][0]
        weight, bias = head[:4].reshape(2, 2), head[4:]
        rows = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
        losses[epochs] = float(torch.nn.functional.cross_entropy(rows @ weight.t() + bias, torch.tensor([0, 1, 0])))
    assert losses[20] < losses[1] < float(torch.log(torch.tensor(2.0)))


def test_bad_uploads_are_refused():
    server = _server()
    before = server.download()["head"].clone()
    assert torch.equal(server.download()["head"], before)
    with pytest.raises(ProtocolError, match="outside"):
        server.validate_upload(1, {"class_ids": torch.tensor([0, 5]), "protos": torch.zeros(2, 2)})
    with pytest.raises(ProtocolError, match="twice"):
        server.validate_upload(1, {"class_ids": torch.tensor([1, 1]), "protos": torch.zeros(2, 2)})


def test_initial_head_is_client_0s():
    entry, context = make_context("fedgh")
    torch.testing.assert_close(entry.server(context).download()["head"], head_row(make_client(context, 0).model.head),
                               rtol=0, atol=0)


def test_client_uploads_post_update_prototypes_after_the_head_swap():
    entry, context = make_context("fedgh", lr=0.05)
    client = make_client(context, 1)
    before = client.model.features(client.train_x).detach()
    knowledge = {"head": torch.full((1, 15), 0.1)}
    result = entry.client(context).train(client, knowledge, 0, torch_generator(0, "batches", 1, 0))
    client.model.eval()
    with torch.no_grad():
        after = client.model.features(client.train_x)
    labels = client.train_y
    expected = torch.stack([after[labels == c].mean(dim=0) for c in range(3)])
    stale = torch.stack([before[labels == c].mean(dim=0) for c in range(3)])
    assert result.upload["class_ids"].tolist() == [0, 1, 2]
    torch.testing.assert_close(result.upload["protos"], expected)
    assert not torch.allclose(result.upload["protos"], stale)
    assert set(result.upload) == {"class_ids", "protos"}
    assert entry.client(context).theory_upload_floats(client) == 3 * 4  # m_i·K


def test_head_swap_before_training_and_evaluation():
    entry, context = make_context("fedgh", lr=0.0)
    client = make_client(context, 1)
    knowledge = {"head": torch.full((1, 15), 0.1)}
    entry.client(context).train(client, knowledge, 0, torch_generator(0, "batches", 1, 0))
    torch.testing.assert_close(head_row(client.model.head), knowledge["head"])
    entry.client(context).prepare_evaluation(client, {"head": torch.full((1, 15), -0.2)})
    torch.testing.assert_close(head_row(client.model.head), torch.full((1, 15), -0.2))


def test_heterogeneous_heads_are_refused():
    entry, context = make_context("fedgh", group="htcnn1:fc,htcnn2:fc512")
    with pytest.raises(ConfigError, match="FedGH shares the head"):
        entry.client.check_models(context)


@pytest.mark.parametrize("options,key", [({"server_epochs": 0}, "algo.server_epochs"),
                                         ({"server_lr": 0}, "algo.server_lr"),
                                         ({"server_batch_size": 0}, "algo.server_batch_size"),
                                         ({"compat": "other"}, "algo.compat")])
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_options(get_algorithm("fedgh"), options)


@pytest.mark.integration
def test_real_run(single_run):
    rows = launch_smoke(single_run, "fedgh")
    assert all(r["server_pairs"] > 0 for r in rows)


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_upload_fields_are_class_ids_and_k_wide_prototypes():
    from htfl_dist.payload import Field

    entry, context = make_context("fedgh")  # C = 3, K = 4
    assert entry.client.upload_fields(context) == (
        Field("class_ids", torch.int64, (), max_rows=3), Field("protos", torch.float32, (4,), max_rows=3))


def test_bad_upload_message_names_the_client():
    server = _server()
    with pytest.raises(ProtocolError) as info:
        server.validate_upload(1, {"class_ids": torch.tensor([1, 1]), "protos": torch.zeros(2, 2)})
    assert str(info.value) == "client 1 sent a class id twice"


def test_uploads_without_pairs_keep_the_head_and_a_single_pair_trains_it():
    server = _server(server_lr=0.4)
    start = torch.tensor([[0.0, 0.0, 0.0, 0.0, math.log(3.0), 0.0]])  # W = 0, b = (ln 3, 0)
    server.load_state_dict({"head": start})
    empty = {0: {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}}
    assert server.update(empty, 0, torch_generator(0, "server", 0)) == {}
    assert torch.equal(server.download()["head"], start)
    # one pair (P, c) = ((1, 0), 0): softmax(b) = (¾, ¼), s − onehot = (−¼, ¼);
    # dW = [(−¼, 0), (¼, 0)], db = (−¼, ¼); step −0.4·grad = (0.1, 0, −0.1, 0, 0.1, −0.1), norm 0.2
    diagnostics = server.update({0: {"class_ids": torch.tensor([0]), "protos": torch.tensor([[1.0, 0.0]])}}, 1,
                                torch_generator(0, "server", 1))
    expected = torch.tensor([[0.1, 0.0, -0.1, 0.0, math.log(3.0) + 0.1, -0.1]])
    torch.testing.assert_close(server.download()["head"], expected)
    assert diagnostics["server_pairs"] == 1
    assert diagnostics["head_change"] == pytest.approx(0.2, rel=1e-5)
    assert diagnostics["server_loss"] == pytest.approx(math.log(4 / 3), rel=1e-6)  # CE before the step


def test_pairs_are_shuffled_by_the_given_stream():
    server = _server()
    generator = torch_generator(0, "server", 0)
    state = generator.get_state().clone()
    server.update(_pairs(), 0, generator)
    assert not torch.equal(generator.get_state(), state)
