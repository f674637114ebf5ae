"""Width slicing (issue 49 item 2): indices and holder-wise aggregation, by hand."""
import torch

from htfl_dist.algorithms.blocks.width_slice import aggregate, kept_width, slice_indices, slice_tensor


def test_static_takes_first_ceil_p_w():
    assert slice_indices(8, 0.5, "static").tolist() == [0, 1, 2, 3]
    assert kept_width(6, 0.25) == 2  # ceil(1.5)


def test_rolling_forward_starts_at_round_mod_width_and_wraps():
    assert slice_indices(4, 0.5, "rolling", round_index=0, direction=1).tolist() == [0, 1]
    assert slice_indices(4, 0.5, "rolling", round_index=3, direction=1).tolist() == [3, 0]
    assert slice_indices(4, 0.5, "rolling", round_index=5, direction=1).tolist() == [1, 2]


def test_rolling_default_is_fedrolex_official_direction():
    # FedRolex resnet_server.py: first k of torch.roll(arange(W), t): round 1 on W=4 is [3, 0, 1, 2] -> [3, 0]
    assert slice_indices(4, 0.5, "rolling", round_index=1).tolist() == [3, 0]
    assert slice_indices(4, 0.5, "rolling", round_index=3).tolist() == [1, 2]
    assert slice_indices(5, 0.4, "rolling", round_index=7).tolist() == [3, 4]  # (-7) mod 5 = 3
    assert slice_indices(4, 0.5, "rolling", round_index=0).tolist() == [0, 1]


def test_random_is_seeded_and_sized():
    a = slice_indices(8, 0.5, "random", round_index=2, seed=1, client=3)
    assert a.tolist() == slice_indices(8, 0.5, "random", round_index=2, seed=1, client=3).tolist()
    assert len(set(a.tolist())) == 4


def test_aggregate_three_clients_by_hand():
    # global: layer1 weight 4x2 (out x in), layer2 weight 2x4; rates 1, 1/2, 1/4 static
    g = {"w1": torch.zeros(4, 2), "w2": torch.full((2, 4), 9.0)}
    ups = []
    for value, rate in ((1.0, 1.0), (2.0, 0.5), (4.0, 0.25)):
        h = slice_indices(4, rate, "static")
        ups.append(({"w1": torch.full((len(h), 2), value), "w2": torch.full((2, len(h)), value)},
                    {"w1": [h, None], "w2": [None, h]}))
    out = aggregate(g, ups)
    # hidden unit 0: held by all three -> (1+2+4)/3; unit 1: (1+2)/2; units 2,3: 1
    assert torch.allclose(out["w1"][:, 0], torch.tensor([7 / 3, 1.5, 1.0, 1.0]))
    assert torch.allclose(out["w2"][0], torch.tensor([7 / 3, 1.5, 1.0, 1.0]))


def test_entries_held_by_nobody_keep_their_value():
    g = {"w": torch.arange(4.0)}
    h = slice_indices(4, 0.5, "rolling", round_index=1, direction=1)  # [1, 2]
    out = aggregate(g, [({"w": torch.tensor([10.0, 20.0])}, {"w": [h]})])
    assert out["w"].tolist() == [0.0, 10.0, 20.0, 3.0]
    assert slice_tensor(out["w"], [h]).tolist() == [10.0, 20.0]
