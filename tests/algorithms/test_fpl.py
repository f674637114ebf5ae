"""FPL maths by hand: FINCH's first neighbours, components and partitions on a few points, the
server's cluster and unbiased prototypes, FPCL and UPCR and their gradients, the client's loss
through ``train``, the download's and upload's validation, and the options."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import make_context, roundtrip, tiny_identity_client
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.batches import Batch
from htfl_dist.algorithms.fpl import (
    PrototypeTargets,
    check_download,
    finch,
    first_neighbours,
    fpcl_terms,
    fpl_regulariser,
    linked_components,
    upcr_terms,
)
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import SplitModel, initial_client_model
from htfl_dist.payload import max_message_bytes
from htfl_dist.runtime.transport import checked_sizes
from htfl_dist.runtime.wire import encode
from htfl_dist.seeding import torch_generator

# Four pairs of 2-d points, by angle: A 0° and 5.7°, B 45° and 48°, C 135° and 138°, D 180° and
# 185.7°. Partition 0 pairs them up; the pair means sit at 2.9°, 46.5°, 136.5° and 182.9°, so A–B
# (43.6° apart) and C–D (46.4°) link at partition 1; its two means would merge into one cluster,
# which FINCH does not return.
EIGHT = [[1.0, 0.0], [1.0, 0.1], [1.0, 1.0], [0.9, 1.0], [-1.0, 1.0], [-1.0, 0.9], [-1.0, 0.0], [-1.0, -0.1]]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _upload(class_ids, protos):
    return {"class_ids": torch.tensor(class_ids, dtype=torch.int64), "protos": _t(protos)}


def _download(class_ids, protos, cluster_class_ids, cluster_protos):
    return {"class_ids": torch.tensor(class_ids, dtype=torch.int64), "protos": _t(protos),
            "cluster_class_ids": torch.tensor(cluster_class_ids, dtype=torch.int64),
            "cluster_protos": _t(cluster_protos)}


def _server(num_classes=2, num_clients=5, **options):
    entry, context = make_context("fpl", num_classes=num_classes, feature_dim=2, num_clients=num_clients, **options)
    return entry.server(context)


def _targets(download, num_classes=2):
    return PrototypeTargets.from_download(download, num_classes, "cpu")


# ------------------------------------------------------------------------------ FINCH

def test_first_neighbour_is_by_cosine_not_distance_and_ties_go_to_the_lower_index():
    """(1, 0) is nearer (1, 0.5) in distance (0.5 against 9.06) but nearer (10, 1) in angle
    (5.7° against 26.6°); (0, 1) sees (1, 0) and (−1, 0) both at cosine 0 and takes index 0."""
    assert first_neighbours(_t([[1.0, 0.0], [10.0, 1.0], [1.0, 0.5]])).tolist() == [1, 0, 1]
    assert first_neighbours(_t([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])).tolist() == [1, 0, 1]
    assert first_neighbours(_t([[3.0, 4.0]])).tolist() == [0]  # alone: its own neighbour


def test_components_link_each_point_to_its_neighbour_and_are_numbered_by_smallest_member():
    """κ = [3, 4, 4, 0, 2]: edges 0–3, 1–4, 2–4, 3–0, 4–2 → {0, 3} and {1, 2, 4}; chains join too."""
    assert linked_components(torch.tensor([3, 4, 4, 0, 2])).tolist() == [0, 1, 1, 0, 1]
    assert linked_components(torch.tensor([1, 2, 3, 2])).tolist() == [0, 0, 0, 0]
    assert linked_components(torch.tensor([4, 3, 3, 2, 0])).tolist() == [0, 1, 1, 1, 0]


def test_finch_on_eight_points_returns_the_pairs_then_the_halves():
    partitions = finch(_t(EIGHT))
    assert [p.tolist() for p in partitions] == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]]


def test_finch_stops_before_one_cluster_and_keeps_a_single_first_partition():
    """Three groups whose means all link together at partition 1: only partition 0 comes back.
    Two points link to each other: one cluster at partition 0, which is returned as it is."""
    three = _t([[1.0, 0.0], [1.0, 0.1], [1.0, -0.1], [-1.0, 0.0], [-1.0, 0.1]])
    assert [p.tolist() for p in finch(three)] == [[0, 0, 0, 1, 1]]
    assert [p.tolist() for p in finch(_t([[1.0, 0.0], [0.0, 1.0]]))] == [[0, 0]]


def test_coarse_centres_are_means_of_the_points_not_of_the_finer_centres():
    """Partition 0: A = (1, 0), (1, 0.1), (1, −0.1) (centre (1, 0), 0°), B = (1, 0.8), (1, 0.9)
    (40.4°), C = (−1, 0), (−1, 0.1) (177.1°), D = (−1, −0.8), (−1, −0.9) (220.4°); partition 1
    links A–B (40.4° apart) and C–D (43.3°). The A∪B centre is the mean of its five points,
    (1, 1.7/5) = (1, 0.34), not the mean of A's and B's centres (1, 0.425); C∪D's is (−1, −0.4)."""
    points = _t([[1.0, 0.0], [1.0, 0.1], [1.0, -0.1], [1.0, 0.8], [1.0, 0.9], [-1.0, 0.0], [-1.0, 0.1],
                 [-1.0, -0.8], [-1.0, -0.9]])
    assert [p.tolist() for p in finch(points)] == [[0, 0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 0, 1, 1, 1, 1]]
    server = _server(num_classes=1, num_clients=9)
    server.update({i: _upload([0], [p]) for i, p in enumerate(points.tolist())}, 0, torch_generator(0, "s"))
    torch.testing.assert_close(server.download()["cluster_protos"], _t([[1.0, 0.34], [-1.0, -0.4]]))
    torch.testing.assert_close(server.download()["protos"], _t([[0.0, -0.03]]))


# ------------------------------------------------------------------------------ the server

def test_server_clusters_each_class_and_averages_the_cluster_centres():
    """Class 0 from five clients: (1, 0), (1, 0.1), (1, −0.1) form one cluster (centre (1, 0)) and
    (−1, 0), (−1, 0.1) another (centre (−1, 0.05)); the unbiased prototype is their plain mean
    (0, 0.025), not the mean of the five uploads (0.2, 0.02). Class 1 from client 4 alone: itself.
    Clusters come in class order, then in order of their first uploader (client id order)."""
    uploads = {4: _upload([0, 1], [[-1.0, 0.1], [2.0, 3.0]]), 0: _upload([0], [[1.0, 0.0]]),
               3: _upload([0], [[-1.0, 0.0]]), 1: _upload([0], [[1.0, 0.1]]), 2: _upload([0], [[1.0, -0.1]])}
    server = _server()
    metrics = server.update(uploads, 0, torch_generator(0, "s"))
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(download["protos"], _t([[0.0, 0.025], [2.0, 3.0]]))
    assert download["cluster_class_ids"].tolist() == [0, 0, 1]
    torch.testing.assert_close(download["cluster_protos"], _t([[1.0, 0.0], [-1.0, 0.05], [2.0, 3.0]]))
    assert (metrics["global_classes"], metrics["clusters"], metrics["clusters_per_class_max"]) == (2, 3, 2)
    check_download(download, server.context)  # what the server sends passes the client's check
    assert server.theory_download_floats() == 2 * (3 + 2)


@pytest.mark.parametrize("partition,centres,unbiased", [
    ("coarsest", [[0.975, 0.525], [-1.0, 0.45]], [-0.0125, 0.4875]),
    ("finest", [[1.0, 0.05], [0.95, 1.0], [-1.0, 0.95], [-1.0, -0.05]], [-0.0125, 0.4875]),
])
def test_server_takes_the_partition_the_option_names(partition, centres, unbiased):
    """The eight points from eight clients: the halves' centres (3.9, 2.1)/4 and (−4, 1.8)/4, or
    the four pairs' centres; both average to (−0.05, 1.95)/4."""
    server = _server(num_classes=1, num_clients=8, finch_partition=partition)
    server.update({i: _upload([0], [p]) for i, p in enumerate(EIGHT)}, 0, torch_generator(0, "s"))
    download = server.download()
    torch.testing.assert_close(download["cluster_protos"], _t(centres))
    torch.testing.assert_close(download["protos"], _t([unbiased]))


def test_server_forgets_classes_not_uploaded_and_keeps_state():
    server = _server()
    server.update({0: _upload([0, 1], [[1.0, 0.0], [0.0, 1.0]])}, 0, torch_generator(0, "s"))
    server.update({1: _upload([1], [[0.0, 2.0]])}, 1, torch_generator(0, "s"))
    before = server.download()
    assert before["class_ids"].tolist() == [1] and before["cluster_class_ids"].tolist() == [1]
    fresh = _server()
    fresh.load_state_dict(roundtrip(server.state_dict()))
    for key, tensor in before.items():
        torch.testing.assert_close(server.download()[key], tensor, rtol=0, atol=0)
        torch.testing.assert_close(fresh.download()[key], tensor, rtol=0, atol=0)


# ------------------------------------------------------------------------------ the losses

# class 0's clusters (1, 0) and (0, 1), unbiased (0.5, 0.5); class 1's cluster (−1, 0), unbiased (−1, 0)
KNOWLEDGE = _download([0, 1], [[0.5, 0.5], [-1.0, 0.0]], [0, 0, 1], [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
FPCL_1 = math.log(1 + math.exp(-2) / (math.exp(2) + 1))
"""z = (2, 0), class 0, τ = 0.5: cosines 1, 0, −1 → logits 2, 0, −2; −log((e² + 1)/(e² + 1 + e⁻²))."""
FPCL_2 = math.log(2 + math.exp(2))
"""z = (0, 3), class 1: cosines 0, 1, 0 → logits 0, 2, 0; −log(e⁰/(1 + e² + 1))."""


def test_fpcl_by_hand():
    terms = fpcl_terms(_t([[2.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1]), _targets(KNOWLEDGE), 0.5)
    torch.testing.assert_close(terms, torch.tensor([FPCL_1, FPCL_2]))


def test_fpcl_is_cosine_so_the_lengths_of_features_and_prototypes_do_not_count():
    """The same directions as KNOWLEDGE's clusters at lengths 3, 0.5 and 7, and features 10× longer:
    the same two values."""
    longer = _download([0, 1], [[0.5, 0.5], [-1.0, 0.0]], [0, 0, 1], [[3.0, 0.0], [0.0, 0.5], [-7.0, 0.0]])
    terms = fpcl_terms(_t([[20.0, 0.0], [0.0, 30.0]]), torch.tensor([0, 1]), _targets(longer), 0.5)
    torch.testing.assert_close(terms, torch.tensor([FPCL_1, FPCL_2]))


def test_upcr_by_hand():
    """(2, 0) − (0.5, 0.5) = (1.5, −0.5): 2.25 + 0.25 = 2.5; (0, 3) − (−1, 0) = (1, 3): 10. Mean: /K = 2."""
    features, labels = _t([[2.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1])
    torch.testing.assert_close(upcr_terms(features, labels, _targets(KNOWLEDGE), "sum"), torch.tensor([2.5, 10.0]))
    torch.testing.assert_close(upcr_terms(features, labels, _targets(KNOWLEDGE), "mean"), torch.tensor([1.25, 5.0]))


def test_fpcl_gradient_by_hand():
    """At z = (1, 0) (unit), ∂cos(z, c)/∂z = c − (z·c) z: 0 for (1, 0) and (−1, 0), (0, 1) for
    (0, 1). ∂FPCL/∂logit_r = p_r − q_r on the positives (p the softmax over all three logits
    2, 0, −2, q over the positives 2, 0), so ∂FPCL/∂z = (p₂ − q₂)·(0, 1)/τ with p₂ = 1/(e² + 1 + e⁻²)
    and q₂ = 1/(e² + 1)."""
    z = _t([[1.0, 0.0]]).requires_grad_()
    fpcl_terms(z, torch.tensor([0]), _targets(KNOWLEDGE), 0.5).sum().backward()
    p2, q2 = 1 / (math.exp(2) + 1 + math.exp(-2)), 1 / (math.exp(2) + 1)
    torch.testing.assert_close(z.grad, _t([[0.0, (p2 - q2) / 0.5]]))


def test_upcr_gradient_and_the_batch_mean_by_hand():
    """∂/∂z of (1/B) Σ ‖z − Ũ^y‖² is 2(z − Ũ^y)/B: (3, −1)/2 and (2, 6)/2 (fpcl_weight 0,
    upcr_reduction=sum; the default mean divides by K = 2)."""
    _, context = make_context("fpl", num_classes=2, feature_dim=2, fpcl_weight=0.0, upcr_reduction="sum")
    z = _t([[2.0, 0.0], [0.0, 3.0]]).requires_grad_()
    fpl_regulariser(context.options, Batch(z, torch.tensor([0, 1]), z, z), _targets(KNOWLEDGE)).backward()
    torch.testing.assert_close(z.grad, _t([[1.5, -0.5], [1.0, 3.0]]))


def test_a_class_without_prototypes_adds_nothing_but_counts_in_the_batch_and_padding_does_not():
    """C = 3, class 2 has no prototype: its sample adds 0, finite, with no gradient, and the mean
    is over the three samples (the reference divides by the whole batch). A zero-weight padding row
    changes nothing."""
    _, context = make_context("fpl", num_classes=3, feature_dim=2, tau=0.5, upcr_reduction="sum")
    targets = PrototypeTargets.from_download(KNOWLEDGE, 3, "cpu")
    z = _t([[2.0, 0.0], [0.0, 3.0], [5.0, 5.0]]).requires_grad_()
    labels = torch.tensor([0, 1, 2])
    value = fpl_regulariser(context.options, Batch(z, labels, z, z), targets)
    assert value.item() == pytest.approx((FPCL_1 + 2.5 + FPCL_2 + 10.0) / 3, rel=1e-6)
    value.backward()
    assert z.grad[2].tolist() == [0.0, 0.0] and torch.isfinite(z.grad).all()
    padded = fpl_regulariser(context.options, Batch(z, labels, z, z, torch.tensor([1.0, 1.0, 1.0])), targets)
    unpadded = fpl_regulariser(context.options, Batch(z[:2], labels[:2], z[:2], z[:2]), targets)
    with_pad = fpl_regulariser(context.options, Batch(z, labels, z, z, torch.tensor([1.0, 1.0, 0.0])), targets)
    torch.testing.assert_close(padded, value)
    torch.testing.assert_close(with_pad, unpadded)


# ------------------------------------------------------------------------------ the client

def test_client_loss_is_ce_plus_fpcl_plus_upcr_and_ce_alone_before_any_download():
    """Zero head: CE = ln 2. Samples (2, 0) of class 0 and (0, 3) of class 1 against KNOWLEDGE:
    ln 2 + ½[(FPCL₁ + 2.5) + (FPCL₂ + 10)]; the weights scale each term."""
    entry, context = make_context("fpl", num_classes=2, feature_dim=2, batch_size=2, tau=0.5, upcr_reduction="sum")
    client = tiny_identity_client([[2.0, 0.0], [0.0, 3.0]], [0, 1])
    result = entry.client(context).train(client, KNOWLEDGE, 1, torch_generator(0, "t"))
    assert result.samples == 2
    assert result.loss_sum / 2 == pytest.approx(math.log(2) + (FPCL_1 + 2.5 + FPCL_2 + 10.0) / 2, rel=1e-6)
    assert result.upload["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(result.upload["protos"], _t([[2.0, 0.0], [0.0, 3.0]]))
    entry, context = make_context("fpl", num_classes=2, feature_dim=2, batch_size=2, tau=0.5,
                                  fpcl_weight=2.0, upcr_weight=0.5, upcr_reduction="mean")
    result = entry.client(context).train(client, KNOWLEDGE, 1, torch_generator(0, "t"))
    assert result.loss_sum / 2 == pytest.approx(math.log(2) + (2 * (FPCL_1 + FPCL_2) + 0.5 * (1.25 + 5.0)) / 2,
                                                rel=1e-6)
    empty = _server().download()
    result = entry.client(context).train(client, empty, 0, torch_generator(0, "t"))
    assert result.loss_sum / 2 == pytest.approx(math.log(2), rel=1e-6)


def test_client_classifies_with_its_own_head():
    entry, context = make_context("fpl", num_classes=2, feature_dim=2)
    logits = _t([[0.0, 1.0], [3.0, -1.0]])
    predicted = entry.client(context).predict(None, KNOWLEDGE, _t([[1.0, 0.0], [-1.0, 0.0]]), logits)
    assert predicted.tolist() == [1, 0]


# ------------------------------------------------------------------------------ validation

def _context(num_classes=2, num_clients=2):
    return make_context("fpl", num_classes=num_classes, feature_dim=2, num_clients=num_clients)[1]


@pytest.mark.parametrize("download,message", [
    (_download([0, 1], [[1.0, 0.0], [0.0, 1.0]], [0, 0, 1, 1, 1], [[1.0, 0.0]] * 5), "at most C·N"),
    (_download([0], [[1.0, 0.0]], [0, 0, 0], [[1.0, 0.0]] * 3), "more than N = 2"),
    (_download([0], [[1.0, 0.0]], [0, 2], [[1.0, 0.0]] * 2), "outside"),
    (_download([0], [[1.0, 0.0]], [0, -1], [[1.0, 0.0]] * 2), "outside"),
    (_download([2], [[1.0, 0.0]], [0], [[1.0, 0.0]]), "outside"),
    (_download([0, 0], [[1.0, 0.0]] * 2, [0], [[1.0, 0.0]]), "^the server sent a class id twice$"),
    (_download([0], [[1.0, 0.0]], [0, 1], [[1.0, 0.0]] * 2), "different classes"),
    (_download([0, 1], [[1.0, 0.0]] * 2, [0], [[1.0, 0.0]]), "different classes"),
    (_download([0], [[1.0, 0.0]], [0, 0], [[1.0, 0.0]]), "cluster rows"),
    (_download([0], [[1.0, 0.0, 0.0]], [0], [[1.0, 0.0]]), "wide"),
])
def test_a_download_the_server_cannot_have_sent_is_refused(download, message):
    with pytest.raises(ProtocolError, match=message):
        check_download(download, _context())


def test_the_client_checks_its_download_before_training():
    entry, context = make_context("fpl", num_classes=2, feature_dim=2, num_clients=1)
    bad = _download([0], [[1.0, 0.0]], [0, 0], [[1.0, 0.0]] * 2)  # 2 clusters, one client
    with pytest.raises(ProtocolError, match="more than N = 1"):
        entry.client(context).train(tiny_identity_client([[1.0, 0.0]], [0]), bad, 0, torch_generator(0, "t"))


def test_an_upload_with_a_bad_class_id_or_too_many_rows_is_refused():
    """Class ids twice or off [0, C) are refused by the server; C + 1 rows are refused by rank 0
    before it allocates them (the declared max_rows bound the message's size)."""
    entry, context = make_context("fpl", num_classes=2, feature_dim=2)
    server = entry.server(context)
    for upload, message in ((_upload([0, 0], [[1.0, 0.0]] * 2), "twice"), (_upload([2], [[1.0, 0.0]]), "outside"),
                            (_upload([-1], [[1.0, 0.0]]), "outside")):
        with pytest.raises(ProtocolError, match=message):
            server.validate_upload(0, upload)
    spec = entry.client.upload_fields(context)
    bound = max_message_bytes(spec, 1)
    fits = encode(spec, {0: _upload([0, 1], [[1.0, 0.0]] * 2)})
    checked_sizes([fits.header.numel(), fits.body.numel()], 1, 1 << 30, bound)
    too_many = encode(spec, {0: _upload([0, 1, 1], [[1.0, 0.0]] * 3)})
    with pytest.raises(ProtocolError, match="at most"):
        checked_sizes([too_many.header.numel(), too_many.body.numel()], 1, 1 << 30, bound)


def test_download_fields_bound_the_cluster_rows_by_classes_times_clients():
    entry, context = make_context("fpl", num_classes=3, feature_dim=4, num_clients=5)
    fields = {field.name: field.max_rows for field in entry.server.download_fields(context)}
    assert fields == {"class_ids": 3, "protos": 3, "cluster_class_ids": 15, "cluster_protos": 15}


# ------------------------------------------------------------------------------ options

def test_defaults_and_refused_options():
    entry = get_algorithm("fpl")
    options = parse_options(entry, {})
    assert (options.tau, options.fpcl_weight, options.upcr_weight, options.upcr_reduction,
            options.finch_partition, options.proto_from, options.proto_epochs) == (
        0.02, 1.0, 1.0, "mean", "coarsest", "during_training", "last")  # WenkeHuang/RethinkFL@74201b3
    for raw in ({"tau": 0.0}, {"upcr_weight": -1.0}, {"fpcl_weight": -0.5}, {"upcr_reduction": "max"},
                {"finch_partition": "middle"}, {"proto_from": "later"}, {"proto_epochs": "first"}):
        with pytest.raises(ConfigError):
            parse_options(entry, raw)


# ------------------------------------------------------------------------------ the uploaded prototypes

def _trainable_client(lr):
    """A 2-d linear extractor and head, both trained by CE (so the features move every step)."""
    torch.manual_seed(5)
    model = SplitModel(nn.Linear(2, 2), nn.Linear(2, 2), feature_dim=2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0], [-1.0, 2.0], [0.5, 0.5]])
    y = torch.tensor([0, 1, 0, 1, 1, 0])
    return ClientState(0, "tiny", model, torch.optim.SGD(model.parameters(), lr=lr), x, y, x, y, torch.device("cpu"))


def _reference_prototypes(client, epochs, batch_size, lr, last_only):
    """The reference's recipe (models/fpl.py:FPL._train_net, CE only before any download): SGD over
    the stored order; f = net.features(images) before each step, appended per label in the last
    epoch (``if iter == self.local_epoch - 1``; every epoch with ``last_only`` False), then
    ``agg_func``: each label's mean."""
    model = copy.deepcopy(client.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    collected = {}
    for epoch in range(epochs):
        for start in range(0, client.train_y.shape[0], batch_size):
            images, labels = client.train_x[start:start + batch_size], client.train_y[start:start + batch_size]
            optimizer.zero_grad()
            f = model.feature_extractor(images)
            nn.functional.cross_entropy(model.head(f), labels).backward()
            optimizer.step()
            if epoch == epochs - 1 or not last_only:
                for i in range(len(labels)):
                    collected.setdefault(labels[i].item(), []).append(f[i, :].detach())
    return {label: torch.stack(rows).mean(dim=0) for label, rows in collected.items()}


@pytest.mark.parametrize("proto_epochs", ["last", "all"])
def test_prototypes_are_the_reference_codes_last_epoch_batch_features(proto_epochs):
    """6 samples, batch 2, 3 epochs of 3 steps, stored order: the upload is the reference's per-label mean of the
    features of the last epoch's batches (``proto_epochs=all``: of every epoch, HtFLlib FedProto's
    rule), and the two differ since the extractor moves every step."""
    lr, epochs = 0.5, 3
    entry = get_algorithm("fpl")
    context = AlgorithmContext(num_classes=2, feature_dim=2, seed=0, num_clients=1,
                               options=parse_options(entry, {"proto_epochs": proto_epochs}),
                               train=TrainConfig(batch_size=2, lr=lr, local_epochs=epochs, batch_order="fixed"))
    client = _trainable_client(lr)
    expected = _reference_prototypes(client, epochs, 2, lr, last_only=proto_epochs == "last")
    other = _reference_prototypes(client, epochs, 2, lr, last_only=proto_epochs != "last")
    empty = _server().download()
    upload = entry.client(context).train(client, empty, 0, torch_generator(0, "t")).upload
    assert upload["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(upload["protos"], torch.stack([expected[0], expected[1]]))
    assert (upload["protos"] - torch.stack([other[0], other[1]])).abs().max() > 1e-3


# ------------------------------------------------------------------------------ batched clients

@pytest.mark.parametrize("options,batch_order,last_batch", [
    ({}, "shuffled", "keep"),
    ({"proto_from": "during_training", "upcr_reduction": "mean"}, "fixed", "drop"),
    ({"proto_from": "during_training", "proto_epochs": "all"}, "shuffled", "keep"),
    ({"proto_from": "post_update"}, "fixed", "keep"),
])
def test_batched_clients_end_where_one_by_one_training_ends(options, batch_order, last_batch):
    """train.client_batching=vmap: FPL's loss averages over the real rows (weights), so a group of
    htcnn1 clients (partial batches, one client too small for a full batch, class 2 without
    prototypes) ends where training them one by one ends."""
    entry = get_algorithm("fpl")
    context = AlgorithmContext(num_classes=4, feature_dim=16, seed=0, num_clients=3,
                               options=parse_options(entry, {"tau": 0.5, **options}),
                               train=TrainConfig(batch_size=10, lr=0.01, local_epochs=2, batch_order=batch_order,
                                                 last_batch=last_batch))
    protos = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    knowledge = {"class_ids": torch.tensor([0, 1, 3]), "protos": protos,
                 "cluster_class_ids": torch.tensor([0, 0, 1, 3]),
                 "cluster_protos": torch.cat([protos[:1] + 0.3, protos])}

    def clients():
        data = torch.Generator().manual_seed(7)
        made = []
        for client_id, count in enumerate((23, 8, 21)):
            model = initial_client_model("htcnn1", 0, 0, num_classes=4, feature_dim=16, in_channels=1, image_size=12)
            x = torch.randn(count, 1, 12, 12, generator=data)
            y = torch.randint(0, 4, (count,), generator=data)
            made.append(ClientState(client_id, "htcnn1", model, torch.optim.SGD(model.parameters(), lr=0.01),
                                    x, y, x, y, torch.device("cpu")))
        return made

    def generators(group):
        return [torch_generator(0, "batches", client.client_id, 4) for client in group]

    client = entry.client(context)
    alone, grouped = clients(), clients()
    expected = [client.train(c, knowledge, 4, g) for c, g in zip(alone, generators(alone), strict=True)]
    got = client.train_group(grouped, knowledge, 4, generators(grouped))
    for a, b, result, batched in zip(alone, grouped, expected, got, strict=True):
        assert batched.samples == result.samples
        assert batched.loss_sum == pytest.approx(result.loss_sum, rel=1e-5, abs=1e-6)
        for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        for key, value in result.upload.items():
            torch.testing.assert_close(batched.upload[key], value, rtol=1e-5, atol=1e-6)
