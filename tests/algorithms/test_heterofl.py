"""HeteroFL and FedRolex: the server's width-sliced aggregation worked out by hand on the last two
layers (the last hidden width K and the head), the rolling window at round t in FedRolex's
official direction, label masking, the wire, and one real run of each name through the
conformance kit."""
from __future__ import annotations

import pytest
import torch
from helpers import launch_smoke, make_client, make_context

from conftest import SMOKE
from htfl_dist import testing
from htfl_dist.algorithms.heterofl import Layout
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.seeding import torch_generator

K, C = 4, 3  # hidden widths ceil(p * (64, 128, 256, K)); head Linear(K, C)
GROUP = "hetero_cnn_a,hetero_cnn_b,hetero_cnn_c"  # rates 1, 1/2, 1/4: K-widths 4, 2, 1


def _context(algorithm="heterofl", **options):
    return make_context(algorithm, num_classes=C, feature_dim=K, num_clients=3, group=GROUP, **options)


def _uploads(layout, values, classes):
    return {client_id: {"params": torch.full((layout.upload_floats(client_id),), float(value)),
                        "class_ids": torch.tensor(held)}
            for client_id, (value, held) in enumerate(zip(values, classes, strict=True))}


def _head(server):
    state = server.layout.unflatten(server.row)
    return state["head.weight"], state["head.bias"], state["feature_extractor.0.weight"]


def test_static_aggregation_by_hand_with_held_classes():
    entry, context = _context()
    server = entry.server(context)
    weight0, bias0, _ = (t.clone() for t in _head(server))
    # client 0 (rate 1) holds classes {0, 1} and sends 1s, client 1 (rate 1/2) {0, 2} and 2s, client 2 (1/4) {0} and 4s
    server.update(_uploads(server.layout, (1, 2, 4), ([0, 1], [0, 2], [0])), 0, torch_generator(0, "server", 0))
    weight, bias, conv = _head(server)
    # head column j is held by the clients whose K-width exceeds j: column 0 by all, 1 by clients 0-1, 2-3 by 0
    expected = torch.tensor([[7 / 3, 1.5, 1.0, 1.0],   # class 0: every client holds it
                             [1.0, 1.0, 1.0, 1.0],     # class 1: client 0 only
                             [2.0, 2.0, 0.0, 0.0]])    # class 2: client 1 only; columns 2-3 nobody held
    expected[2, 2:] = weight0[2, 2:]  # kept as they were
    torch.testing.assert_close(weight, expected)
    torch.testing.assert_close(bias, torch.tensor([7 / 3, 1.0, 2.0]))
    assert not torch.equal(bias0, bias)
    # first conv (64 output channels): 0-15 held by all, 16-31 by clients 0-1, 32-63 by client 0
    torch.testing.assert_close(conv[[0, 15, 16, 31, 32, 63], 0, 0, 0], torch.tensor([7 / 3, 7 / 3, 1.5, 1.5, 1.0, 1.0]))


def test_all_head_rows_counts_every_holder():
    entry, context = _context(head_rows="all")
    server = entry.server(context)
    server.update(_uploads(server.layout, (1, 2, 4), ([0], [0], [0])), 0, torch_generator(0, "server", 0))
    weight, bias, _ = _head(server)
    torch.testing.assert_close(weight[2], torch.tensor([7 / 3, 1.5, 1.0, 1.0]))
    torch.testing.assert_close(bias, torch.full((C,), 7 / 3))


def test_fedrolex_window_at_round_t_runs_backwards_as_the_official_code():
    entry, context = _context("fedrolex", head_rows="all")
    server = entry.server(context)
    uploads = _uploads(server.layout, (1, 2, 4), ([0], [0], [0]))
    del uploads[2]
    server.update(uploads, 1, torch_generator(0, "server", 1))
    weight, _, conv = _head(server)
    # round 1, rate 1/2: K = 4 -> 2 columns from (-1) mod 4 = 3: {3, 0}; 64 channels -> 32 from 63: {63, 0..30}
    torch.testing.assert_close(weight[0], torch.tensor([1.5, 1.0, 1.0, 1.5]))
    torch.testing.assert_close(conv[[63, 0, 30, 31, 62], 0, 0, 0], torch.tensor([1.5, 1.5, 1.5, 1.0, 1.0]))
    assert int(server.download()["round"][0]) == 2


def test_client_installs_its_rolled_slice_and_uploads_what_it_holds():
    entry, context = _context("fedrolex")
    server = entry.server(context)
    client_algorithm = entry.client(context)
    client = make_client(context, client_id=1)  # rate 1/2
    knowledge = server.download()
    client_algorithm.install(client, knowledge, 3)  # K = 4, k = 2 from (-3) mod 4 = 1: columns {1, 2}
    global_head = server.layout.unflatten(knowledge["global"])["head.weight"]
    torch.testing.assert_close(client.model.head.weight[:, :2], global_head[:, [1, 2]])
    assert torch.count_nonzero(client.model.head.weight[:, 2:]) == 0  # the padding stays 0
    upload = client_algorithm.make_upload(client)
    assert upload["params"].numel() == client_algorithm.theory_upload_floats(client) == server.layout.upload_floats(1)
    assert upload["class_ids"].tolist() == [0, 1, 2]


def test_label_mask_zeroes_absent_logits_and_predicts_among_held():
    entry, context = _context()
    client_algorithm = entry.client(context)
    client = make_client(context, client_id=0)
    client.train_y = torch.tensor([0, 0, 2])
    logits = torch.tensor([[2.0, 5.0, -2.0], [-1.0, 5.0, -2.0]])
    # class 1 is absent: its logit becomes 0 (the official masked_fill(..., 0), not -inf), so it still
    # wins where every held logit is negative
    assert client_algorithm.predict(client, {}, torch.zeros(2, K), logits).tolist() == [0, 1]
    absent = client_algorithm.absent_classes(client)
    torch.testing.assert_close(client_algorithm.masked(logits, absent), torch.tensor([[2.0, 0.0, -2.0],
                                                                                     [-1.0, 0.0, -2.0]]))
    unmasked = _context(label_mask=False)[0].client(_context(label_mask=False)[1])
    assert unmasked.predict(client, {}, torch.zeros(2, K), logits).tolist() == [1, 1]


def test_validation_refuses_a_wrong_slice_and_foreign_classes():
    entry, context = _context()
    server = entry.server(context)
    good = _uploads(server.layout, (1, 2, 4), ([0], [0], [0]))
    server.validate_upload(1, good[1])
    with pytest.raises(ProtocolError, match="its slice holds"):
        server.validate_upload(1, good[0])
    with pytest.raises(ProtocolError, match="class_ids"):
        server.validate_upload(1, {**good[1], "class_ids": torch.tensor([0, 0])})


def test_a_group_that_is_not_one_width_family_is_refused():
    with pytest.raises(ConfigError, match="width-scaled family"):
        Layout(make_context("heterofl", num_clients=2, group="hetero_cnn_a,htcnn1")[1], "HeteroFL")
    with pytest.raises(ConfigError, match="width-scaled family"):
        Layout(make_context("heterofl", num_clients=2, group="hetero_cnn_a,hetero_resnet18_b")[1], "HeteroFL")


def test_random_slices_differ_by_client_and_are_derived_alike():
    _, context = _context(slice="random")
    layout = Layout(context, "HeteroFL")
    first = layout.indices(1, 4)["feature_extractor.0.weight"][0]
    assert first is not None and first.numel() == 32
    assert torch.equal(first, Layout(context, "HeteroFL").indices(1, 4)["feature_extractor.0.weight"][0])
    other = layout.indices(2, 4)["feature_extractor.0.weight"][0]
    assert other is not None and other.numel() == 16


# --------------------------------------------------------------------------- real runs


@pytest.mark.parametrize("algorithm", ["heterofl", "fedrolex"])
def test_one_round_passes_the_conformance_checks(algorithm, tmp_path, cache_dir):
    played = testing.play_one_round(algorithm, tmp_path, config_file=SMOKE, overrides=[f"data.cache_dir={cache_dir}"])
    testing.check_registration(algorithm)
    testing.check_declared_payloads(played)
    testing.check_parameters_travel_as_registered(played)
    testing.check_state_round_trip(played)


@pytest.mark.parametrize("algorithm", ["heterofl", "fedrolex"])
def test_two_rounds_learn_and_send_the_slices(single_run, algorithm):
    launch_smoke(single_run, algorithm, *testing.run_overrides(algorithm)[2:])
