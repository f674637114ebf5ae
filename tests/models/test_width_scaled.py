"""Width-scaled families (HeteroFL's conv and pre-activation ResNet18): widths by hand, the Scaler,
static BatchNorm, the zero-padded features, the slice plan and the registered names."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.models import build_model, model_groups
from htfl_dist.models.width_scaled import Scaler, member_of, slice_plan


def _build(arch, feature_dim=512, options=None, seed=0):
    torch.manual_seed(seed)
    return build_model(arch, num_classes=10, feature_dim=feature_dim, in_channels=3, image_size=32, options=options)


def _conv_widths(model):
    return [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_cnn_widths_are_ceil_rate_times_the_official_sizes():
    assert _conv_widths(_build("hetero_cnn_a")) == [64, 128, 256, 512]
    assert _conv_widths(_build("hetero_cnn_e")) == [4, 8, 16, 32]  # 64/16, ..., 512/16
    assert _conv_widths(_build("hetero_cnn_c", feature_dim=10)) == [16, 32, 64, 3]  # ceil(10/4) = 3


def test_resnet18_widths_and_shortcuts():
    model = _build("hetero_resnet18_c")  # rate 1/4: 16, 32, 64, 128
    widths = _conv_widths(model)
    assert widths[0] == 16 and widths[-1] == 128
    # stem + 8 blocks x 2 convs + 3 shortcut convs (where the width or stride changes)
    assert len(widths) == 1 + 16 + 3
    assert sum(p.numel() for p in _build("hetero_resnet18_a").parameters()) == pytest.approx(11.17e6, rel=0.01)


def test_scaler_divides_by_the_rate_in_training_only():
    scaler = Scaler(0.25)
    x = torch.tensor([1.0, -2.0])
    assert scaler.train()(x).tolist() == [4.0, -8.0]
    assert scaler.eval()(x).tolist() == [1.0, -2.0]


def test_static_batchnorm_is_the_default_and_options_change_the_norm():
    def norms(model):
        return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]

    static = norms(_build("hetero_cnn_b"))
    assert len(static) == 4 and not any(m.track_running_stats for m in static)
    assert all(m.running_mean is None for m in static)
    assert all(m.track_running_stats for m in norms(_build("hetero_cnn_b", options={"norm": "bn"})))
    assert norms(_build("hetero_resnet18_b", options={"norm": "none"})) == []
    assert not any(isinstance(m, Scaler) for m in _build("hetero_cnn_b", options={"scaler": False}).modules())
    assert sum(isinstance(m, Scaler) for m in _build("hetero_cnn_b").modules()) == 4


@pytest.mark.parametrize("arch", ["hetero_cnn_d", "hetero_resnet18_e"])
def test_features_are_padded_to_k_and_the_logits_are_the_narrow_heads(arch):
    model = _build(arch).eval()
    kept = model.kept_features
    assert kept == (64 if arch == "hetero_cnn_d" else 32)
    x = torch.randn(5, 3, 32, 32)
    features, logits = model.forward_with_features(x)
    assert features.shape == (5, 512) and torch.count_nonzero(features[:, kept:]) == 0
    assert torch.count_nonzero(model.head.weight[:, kept:]) == 0 and torch.count_nonzero(model.head.bias) == 0
    narrow = F.linear(features[:, :kept], model.head.weight[:, :kept], model.head.bias)
    torch.testing.assert_close(logits, narrow)


def test_slice_plan_names_the_sliced_dimensions():
    full, quarter = _build("hetero_cnn_a"), _build("hetero_cnn_c")
    plan = slice_plan(full, quarter)
    assert plan["feature_extractor.0.weight"] == (64, None, None, None)  # input channels (3) are whole
    assert plan["feature_extractor.5.weight"] == (128, 64, None, None)  # conv, scaler, bn, relu, pool, conv
    assert plan["head.weight"] == (None, 512) and plan["head.bias"] == (None,)
    assert set(slice_plan(full, full)["head.weight"]) == {None}


def test_registered_names_and_groups():
    assert member_of("hetero_resnet18_d") == ("resnet18", 0.125)
    assert member_of("HETERO_CNN_B") == ("cnn", 0.5)
    assert member_of("cnn") is None
    assert model_groups()["HeteroCNN-a-e"] == tuple(f"hetero_cnn_{level}" for level in "abcde")
    assert model_groups()["HeteroResNet18-a-e"][-1] == "hetero_resnet18_e"
