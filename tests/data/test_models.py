"""Tests for htfl_dist.models: shapes, head-split pooling, heads, determinism, registry errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.config import PLUGIN_HINT
from htfl_dist.errors import ConfigError
from htfl_dist.models import (
    HEAD_GROUPS,
    FeaturePool,
    SplitModel,
    architecture_for_client,
    architectures,
    build_head,
    build_model,
    heads,
    model_groups,
    register_architecture,
    register_head,
    resolve_group,
    split_architecture,
)
from htfl_dist.models.cnn import plain_cnn
from htfl_dist.models.heads import hidden_fc_head, relu_after_every_fc_head

ALL_ARCHS = (
    ["cnn", "googlenet", "mobilenet_v2"]
    + [f"htcnn{i}" for i in range(1, 9)]
    + [f"resnet{d}" for d in (4, 6, 8, 10, 18, 34, 50, 101, 152)]
)

MORE_ARCHS = (
    ["vit_b_16", "vit_b_32"]
    + ["harcnn_s1", "harcnn_s2", "harcnn_s3", "harcnn1_s1", "harcnn1_s2", "harcnn1_s3", "harcnn3_s1", "harcnn3_s2"]
    + ["fasttext", "text_logreg", "lstm", "gru", "bilstm", "bilstm_attention"]
    + [f"transformer_h{h}_l{n}" for h, n in ((8, 1), (8, 2), (8, 4), (8, 8), (8, 16), (1, 4), (2, 4), (4, 4),
                                              (16, 4), (1, 1), (2, 2), (16, 16))]
    + ["amazon_mlp", "amazon_mlp_200", "amazon_mlp_500", "amazon_mlp_1000_500", "amazon_mlp_1000_500_200"]
)
"""ViTs (image sides divisible by their patch) and the sensor, text and tabular members
(tests/data/test_models_more_kinds.py)."""

WIDTH_SCALED_ARCHS = [f"hetero_{family}_{level}" for family in ("cnn", "resnet18") for level in "abcde"]
"""HeteroFL's width-scaled members (tests/models/test_width_scaled.py)."""

INPUTS = [(1, 28), (3, 32)]  # (in_channels, image_size): Fashion-MNIST and CIFAR shapes


def _build(arch: str, seed: int = 0, **kwargs: int) -> SplitModel:
    torch.manual_seed(seed)
    return build_model(arch, **kwargs)


def _first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


# ---------------------------------------------------------------- shapes


def test_registry_lists_exactly_the_expected_architectures() -> None:
    assert sorted(architectures()) == sorted(ALL_ARCHS + MORE_ARCHS + WIDTH_SCALED_ARCHS)
    # natural order: resnet4 before resnet10 before resnet18
    names = architectures()
    assert names.index("resnet4") < names.index("resnet10") < names.index("resnet18") < names.index("resnet101")


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_feature_and_logit_widths(arch: str) -> None:
    for in_channels, size in INPUTS:
        model = _build(arch, num_classes=7, in_channels=in_channels, image_size=size).eval()
        assert isinstance(model, SplitModel)
        assert model.arch == arch
        assert model.feature_dim == 512
        assert isinstance(model.head, nn.Linear)
        assert (model.head.in_features, model.head.out_features) == (512, 7)
        x = torch.randn(2, in_channels, size, size)
        with torch.no_grad():
            feats, logits = model.forward_with_features(x)
            assert feats.shape == (2, 512)
            assert logits.shape == (2, 7)
            # the three entry points agree (eval mode: no dropout, BN uses running stats)
            assert torch.equal(model.features(x), feats)
            assert torch.equal(model(x), logits)
            assert torch.equal(model.head(feats), logits)
        assert torch.isfinite(feats).all() and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["cnn", "htcnn8", "htcnn1", "resnet4", "googlenet"])
def test_other_feature_dim(arch: str) -> None:
    model = _build(arch, num_classes=3, feature_dim=256, in_channels=1, image_size=28).eval()
    assert model.feature_dim == 256
    assert (model.head.in_features, model.head.out_features) == (256, 3)
    with torch.no_grad():
        feats, logits = model.forward_with_features(torch.randn(2, 1, 28, 28))
    assert feats.shape == (2, 256) and logits.shape == (2, 3)


def test_htcnn_layers_follow_table_9() -> None:
    def layout(arch: str, feature_dim: int = 512) -> tuple[list[int], list[int]]:
        model = _build(arch, num_classes=10, feature_dim=feature_dim, in_channels=1, image_size=28)
        convs = [m for m in model.feature_extractor.modules() if isinstance(m, nn.Conv2d)]
        fcs = [m for m in model.feature_extractor.modules() if isinstance(m, nn.Linear)]
        for conv in convs:
            assert conv.kernel_size == (5, 5) and conv.padding == (0, 0)
        return [c.out_channels for c in convs], [f.out_features for f in fcs]

    assert layout("htcnn1") == ([32], [512])
    assert layout("htcnn2") == ([32, 64], [512])
    assert layout("htcnn3") == ([32], [512, 512])
    assert layout("htcnn4") == ([32, 64], [512, 512])
    assert layout("htcnn5") == ([32], [1024, 512])
    assert layout("htcnn6") == ([32, 64], [1024, 512])
    assert layout("htcnn7") == ([32], [1024, 512, 512])
    assert layout("htcnn8") == ([32, 64], [1024, 512, 512])
    assert layout("cnn") == ([32, 64], [512])
    # only the last extractor fc follows K
    assert layout("htcnn8", feature_dim=128) == ([32, 64], [1024, 512, 128])
    # flatten width computed from the input: 28 -> 24 -> 12 -> 8 -> 4 ; 32 -> 28 -> 14 -> 10 -> 5
    cnn28 = _build("cnn", num_classes=10, in_channels=1, image_size=28)
    cnn32 = _build("cnn", num_classes=10, in_channels=3, image_size=32)
    assert next(m for m in cnn28.feature_extractor if isinstance(m, nn.Linear)).in_features == 64 * 4 * 4
    assert next(m for m in cnn32.feature_extractor if isinstance(m, nn.Linear)).in_features == 64 * 5 * 5


def test_features_end_in_relu_for_cnns() -> None:
    model = _build("htcnn3", num_classes=10, in_channels=1, image_size=28).eval()
    with torch.no_grad():
        assert (model.features(torch.randn(4, 1, 28, 28)) >= 0).all()


@pytest.mark.parametrize("arch", ["googlenet", "mobilenet_v2", "resnet10"])
def test_one_channel_stem_keeps_geometry(arch: str) -> None:
    rgb = _first_conv(_build(arch, num_classes=10, in_channels=3).feature_extractor)
    gray = _first_conv(_build(arch, num_classes=10, in_channels=1).feature_extractor)
    assert (rgb.in_channels, gray.in_channels) == (3, 1)
    for attr in ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
        assert getattr(rgb, attr) == getattr(gray, attr), attr
    assert (rgb.bias is None) == (gray.bias is None)
    # initialised by the architecture's scheme, not left empty
    assert torch.isfinite(gray.weight).all() and gray.weight.std() > 0


def test_shallow_resnets_truncate_stages() -> None:
    widths = {}
    for arch in ("resnet4", "resnet6", "resnet8", "resnet10"):
        model = _build(arch, num_classes=10)
        widths[arch] = model.feature_extractor.fc.in_features
        blocks = [m for m in model.feature_extractor.modules() if type(m).__name__ == "BasicBlock"]
        assert len(blocks) == {"resnet4": 1, "resnet6": 2, "resnet8": 3, "resnet10": 4}[arch]
    assert widths == {"resnet4": 64, "resnet6": 128, "resnet8": 256, "resnet10": 512}


def test_training_step_runs_and_backpropagates() -> None:
    # mobilenet_v2 exercises the general (1280 -> 512) pooling path, resnet4 the repeat path.
    for arch in ("mobilenet_v2", "resnet4", "htcnn1"):
        model = _build(arch, num_classes=10, in_channels=1, image_size=28).train()
        feats, logits = model.forward_with_features(torch.randn(4, 1, 28, 28))
        (F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])) + feats.pow(2).mean()).backward()
        first = _first_conv(model)
        assert first.weight.grad is not None and torch.isfinite(first.weight.grad).all()


def test_too_small_images_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="image_size 14 is too small for architecture 'googlenet'"):
        build_model("googlenet", num_classes=10, image_size=14)
    # two (conv5, pool2) blocks: 16 -> 12 -> 6 -> 2 -> 1, while 15 -> 11 -> 5 -> 1 -> pool fails
    with pytest.raises(ConfigError, match=r"image_size 15 .*'cnn' \(needs >= 16\)"):
        build_model("cnn", num_classes=10, image_size=15)
    build_model("cnn", num_classes=10, image_size=16)
    build_model("googlenet", num_classes=10, image_size=15)
    with pytest.raises(ConfigError, match="needs >= 6"):
        build_model("htcnn1", num_classes=10, image_size=5)


def test_bad_sizes_are_config_errors() -> None:
    for key in ("num_classes", "feature_dim", "in_channels", "image_size"):
        kwargs = {"num_classes": 10, key: 0}
        with pytest.raises(ConfigError, match=key):
            build_model("cnn", **kwargs)


# ---------------------------------------------------------------- head-split pooling


def test_pool_2048_to_512_is_mean_of_groups_of_four() -> None:
    x = torch.randn(3, 2048)
    out = FeaturePool(2048, 512)(x)
    assert out.shape == (3, 512)
    assert torch.equal(out, x.reshape(3, 512, 4).mean(dim=2))
    assert torch.allclose(out[:, 5], x[:, 20:24].mean(dim=1))
    assert torch.allclose(out, F.adaptive_avg_pool1d(x.unsqueeze(1), 512).squeeze(1), atol=1e-6)


def test_pool_1024_to_512_averages_pairs() -> None:
    x = torch.randn(2, 1024)
    assert torch.allclose(FeaturePool(1024, 512)(x), (x[:, 0::2] + x[:, 1::2]) / 2, atol=1e-6)


@pytest.mark.parametrize("width", [64, 128, 256])
def test_pool_narrow_vectors_are_repeated(width: int) -> None:
    x = torch.randn(2, width)
    out = FeaturePool(width, 512)(x)
    assert out.shape == (2, 512)
    assert torch.equal(out, x.repeat_interleave(512 // width, dim=1))
    assert torch.equal(out, F.adaptive_avg_pool1d(x.unsqueeze(1), 512).squeeze(1))


@pytest.mark.parametrize("width,k", [(1280, 512), (512, 512), (100, 512), (1280, 256), (7, 3), (3, 7)])
def test_pool_matches_adaptive_avg_pool1d(width: int, k: int) -> None:
    x = torch.randn(4, width, dtype=torch.float64)
    out = FeaturePool(width, k)(x)
    assert out.shape == (4, k)
    assert torch.allclose(out, F.adaptive_avg_pool1d(x.unsqueeze(1), k).squeeze(1))


def test_pool_has_no_parameters_or_state() -> None:
    pool = FeaturePool(1280, 512)
    assert list(pool.parameters()) == []
    assert pool.state_dict() == {}
    with pytest.raises(ValueError, match=r"\(B, 1280\)"):
        pool(torch.randn(2, 1024))


@pytest.mark.parametrize("arch,penultimate", [("googlenet", 1024), ("mobilenet_v2", 1280), ("resnet50", 2048)])
def test_torchvision_classifier_replaced_by_pool(arch: str, penultimate: int) -> None:
    model = _build(arch, num_classes=10, in_channels=1, image_size=28)
    pools = [m for m in model.feature_extractor.modules() if isinstance(m, FeaturePool)]
    assert len(pools) == 1 and (pools[0].in_features, pools[0].out_features) == (penultimate, 512)
    # the head is the only Linear left outside the extractor; the extractor has none (ResNet/GoogLeNet)
    assert not any(isinstance(m, nn.Linear) for m in model.feature_extractor.modules())


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("arch", ["cnn", "htcnn8", "resnet10", "mobilenet_v2"])
def test_same_seed_same_parameters(arch: str) -> None:
    a = _build(arch, seed=123, num_classes=10, in_channels=1, image_size=28).state_dict()
    b = _build(arch, seed=123, num_classes=10, in_channels=1, image_size=28).state_dict()
    c = _build(arch, seed=124, num_classes=10, in_channels=1, image_size=28).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if k.endswith("weight") and a[k].dtype.is_floating_point and a[k].std() > 0]
    assert weights and all(not torch.equal(a[k], c[k]) for k in weights)


def test_build_model_does_not_seed_the_global_rng() -> None:
    # If the builder re-seeded torch, the RNG state afterwards would not depend on the caller's seed.
    after = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        build_model("resnet4", num_classes=10, in_channels=1, image_size=28)
        after.append(torch.rand(4))
    assert not torch.equal(after[0], after[1])


# ---------------------------------------------------------------- registry / groups


def test_model_groups() -> None:
    groups = model_groups()
    assert groups["HtCNN8"] == tuple(f"htcnn{i}" for i in range(1, 9))
    assert groups["HtFE8"] == (
        "cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    )
    assert groups["HtFE2"] == ("cnn", "resnet18")
    assert groups["HtFE3"] == ("resnet10", "resnet18", "resnet34")
    assert groups["HtFE4"] == ("cnn", "googlenet", "mobilenet_v2", "resnet18")
    assert groups["HtFE9"] == (
        "resnet4", "resnet6", "resnet8", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    )
    registered, registered_heads = set(architectures()), set(heads())
    for members in groups.values():
        for member in members:
            arch, head = split_architecture(member)
            assert arch in registered and head in registered_heads, member
    groups["HtFE2"] = ("x",)  # a copy: callers cannot corrupt the table
    assert model_groups()["HtFE2"] == ("cnn", "resnet18")


def test_architecture_for_client_round_robin() -> None:
    group = model_groups()["HtFE8"]
    assert [architecture_for_client("HtFE8", i) for i in range(20)] == [group[i % 8] for i in range(20)]
    assert [architecture_for_client("HtFE3", i) for i in range(5)] == [
        "resnet10", "resnet18", "resnet34", "resnet10", "resnet18",
    ]
    # a single architecture name is a homogeneous group of one
    assert resolve_group("resnet18") == ("resnet18",)
    assert {architecture_for_client("resnet18", i) for i in range(10)} == {"resnet18"}
    with pytest.raises(ValueError):
        architecture_for_client("HtFE8", -1)


def test_unknown_group_is_config_error_listing_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        architecture_for_client("HtFE7", 0)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "unknown model group 'HtFE7'; allowed: HeteroCNN-a-e, HeteroResNet18-a-e, "
        "HtCNN8, HtFE2, HtFE3, HtFE4, HtFE5, HtFE8, HtFE8-HtC4, "
        "HtFE8-HtC4-htfllib, HtFE9, HtFE-img-2, HtFE-img-3, HtFE-img-4, HtFE-img-5, HtFE-img-8, "
        "HtFE-img-8-HtC-img-4, HtFE-img-9, HtFE-sen-2, HtFE-sen-3, HtFE-sen-5, HtFE-sen-8, HtFE-txt-2, "
        "HtFE-txt-4, HtFE-txt-5-1, HtFE-txt-5-2, HtFE-txt-5-3, HtFE-txt-6, HtM10, HtM-img-10, MLP_1layer, "
        "MLP_layers, MLPs, Res34-HtC4, Res34-HtC4-htfllib, Res34-HtC-img-4"
    )
    assert all(name in message for name in ALL_ARCHS)
    assert message.endswith("optionally as ARCH:HEAD with HEAD one of fc, fc128, fc128_relu, fc256, fc256_relu, "
                            f"fc512, fc512_relu, fc768_tanh, fc_relu; {PLUGIN_HINT})")


def test_unknown_architecture_is_config_error_listing_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("resnet19", num_classes=10)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown architecture 'resnet19'; allowed: ")
    assert all(name in message for name in ALL_ARCHS)
    with pytest.raises(ConfigError, match="unknown architecture 'HtFE8'"):
        build_model("HtFE8", num_classes=10)  # a group is not an architecture


def test_register_architecture_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        @register_architecture("cnn")
        def _again(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
            raise AssertionError("never called")


# ---------------------------------------------------------------- heads (HtC4) and ARCH:HEAD

HTC4 = ("fc", "fc512", "fc256", "fc128")


def _linear_widths(head: nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in head.modules() if isinstance(m, nn.Linear)]


def _state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_head_registry_and_htc4_group() -> None:
    assert heads() == ["fc", "fc128", "fc128_relu", "fc256", "fc256_relu", "fc512", "fc512_relu", "fc768_tanh",
                       "fc_relu"]
    assert HEAD_GROUPS["HtC4"] == HTC4
    assert HEAD_GROUPS["HtC4-htfllib"] == ("fc_relu", "fc512_relu", "fc256_relu", "fc128_relu")
    assert "fc512" not in architectures()  # heads are not architectures


def test_htfllib_heads_put_a_relu_after_every_layer_the_last_included() -> None:
    """HtFLlib's Head, by hand: K=2, hidden 2, C=2 with chosen weights. Ours (paper reading)
    keeps the negative logit; HtFLlib's clamps it to 0."""
    x = torch.tensor([[1.0, -2.0]])
    w1, b1 = torch.tensor([[1.0, 1.0], [-1.0, 0.5]]), torch.tensor([0.0, 0.5])  # hidden: [-1, -1.5] -> relu 0, 0
    w2, b2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([-0.25, 0.75])  # logits: [-0.25, 0.75]
    ours = hidden_fc_head(2, 2, 2)
    theirs = relu_after_every_fc_head(2, (2,), 2)
    for model in (ours, theirs):
        linears = [m for m in model if isinstance(m, nn.Linear)]
        with torch.no_grad():
            linears[0].weight.copy_(w1), linears[0].bias.copy_(b1)
            linears[1].weight.copy_(w2), linears[1].bias.copy_(b2)
    assert ours(x).tolist() == [[-0.25, 0.75]]
    assert theirs(x).tolist() == [[0.0, 0.75]]
    assert _linear_widths(build_head("fc_relu", 512, 10)) == [(512, 10)]
    assert isinstance(build_head("fc_relu", 512, 10)[-1], nn.ReLU)
    assert _linear_widths(build_head("fc256_relu", 512, 10)) == [(512, 256), (256, 10)]
    assert (build_head("fc128_relu", 512, 10)(torch.randn(64, 512)) >= 0).all()
    assert model_groups()["Res34-HtC4-htfllib"] == ("resnet34:fc_relu", "resnet34:fc512_relu",
                                                    "resnet34:fc256_relu", "resnet34:fc128_relu")


@pytest.mark.parametrize("name", HTC4)
def test_head_shapes(name: str) -> None:
    torch.manual_seed(0)
    head = build_head(name, 512, 100)
    assert head(torch.randn(3, 512)).shape == (3, 100)
    assert build_head(name, 64, 7)(torch.randn(2, 64)).shape == (2, 7)


def test_htc4_layer_widths_and_relu() -> None:
    built = {name: build_head(name, 512, 100) for name in HTC4}
    assert type(built["fc"]) is nn.Linear and _linear_widths(built["fc"]) == [(512, 100)]
    for hidden in (512, 256, 128):
        head = built[f"fc{hidden}"]
        assert _linear_widths(head) == [(512, hidden), (hidden, 100)]
        # Linear -> ReLU -> Linear: the nonlinearity keeps the two FCs from collapsing into one
        assert [type(m) for m in head] == [nn.Linear, nn.ReLU, nn.Linear]


def test_build_model_with_head() -> None:
    torch.manual_seed(0)
    plain = build_model("resnet34", num_classes=100)
    torch.manual_seed(0)
    model = build_model("resnet34:fc256", num_classes=100).eval()
    assert model.arch == "resnet34:fc256" and model.feature_dim == 512
    assert _linear_widths(model.head) == [(512, 256), (256, 100)]
    # the extractor is built exactly as for plain resnet34; only the head is replaced
    assert _state_equal(model.feature_extractor, plain.feature_extractor)
    with torch.no_grad():
        feats, logits = model.forward_with_features(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, 512) and logits.shape == (2, 100)


def test_plain_architecture_is_unchanged_and_equals_default_head() -> None:
    # build_model("htcnn1") must give what the htcnn1 builder gives (the pre-head-registry path) ...
    torch.manual_seed(0)
    direct = plain_cnn("htcnn1", (32,), (512,), num_classes=10, feature_dim=512, in_channels=1, image_size=28)
    direct_next = torch.rand(4)
    torch.manual_seed(0)
    built = build_model("htcnn1", num_classes=10, in_channels=1, image_size=28)
    assert _state_equal(built, direct) and torch.equal(torch.rand(4), direct_next)
    assert type(built.head) is nn.Linear
    # ... and ARCH:fc is bit-identical to ARCH (the default head is not rebuilt), RNG state included.
    for arch in ("htcnn1", "resnet4"):
        torch.manual_seed(0)
        a, a_next = build_model(arch, num_classes=10), torch.rand(4)
        torch.manual_seed(0)
        b, b_next = build_model(f"{arch}:fc", num_classes=10), torch.rand(4)
        assert _state_equal(a, b) and torch.equal(a_next, b_next)
        assert b.arch == f"{arch}:fc"


def test_architecture_with_head_is_deterministic_and_trains() -> None:
    a = _build("htcnn1:fc128", seed=5, num_classes=10, in_channels=1, image_size=28)
    b = _build("htcnn1:fc128", seed=5, num_classes=10, in_channels=1, image_size=28)
    c = _build("htcnn1:fc128", seed=6, num_classes=10, in_channels=1, image_size=28)
    assert _state_equal(a, b) and not _state_equal(a, c)
    logits = a.train()(torch.randn(4, 1, 28, 28))
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.head.parameters())


def test_htc4_groups_assign_extractor_and_head_round_robin() -> None:
    htfe8 = model_groups()["HtFE8"]
    assert model_groups()["Res34-HtC4"] == ("resnet34:fc", "resnet34:fc512", "resnet34:fc256", "resnet34:fc128")
    assert len(model_groups()["HtFE8-HtC4"]) == 8
    for i in range(16):
        assert split_architecture(architecture_for_client("HtFE8-HtC4", i)) == (htfe8[i % 8], HTC4[i % 4])
        assert split_architecture(architecture_for_client("Res34-HtC4", i)) == ("resnet34", HTC4[i % 4])
    assert architecture_for_client("HtFE8-HtC4", 5) == "resnet50:fc512"
    # a single ARCH:HEAD is a homogeneous group of one
    assert resolve_group("resnet34:fc512") == ("resnet34:fc512",)
    assert {architecture_for_client("htcnn1:fc128", i) for i in range(5)} == {"htcnn1:fc128"}


def test_unknown_head_is_one_line_config_error() -> None:
    expected = ("unknown head 'fc64' in 'resnet34:fc64'; allowed heads: fc, fc128, fc128_relu, fc256, fc256_relu, "
                "fc512, fc512_relu, fc768_tanh, fc_relu")
    for call in (
        lambda: build_model("resnet34:fc64", num_classes=10),
        lambda: resolve_group("resnet34:fc64"),
        lambda: architecture_for_client("resnet34:fc64", 0),  # what main.py checks before launching
    ):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == expected
    with pytest.raises(ConfigError, match="unknown head '' in 'cnn:'"):
        build_model("cnn:", num_classes=10)
    with pytest.raises(ConfigError, match="unknown head 'x'; allowed heads: fc, fc128"):
        build_head("x", 512, 10)
    with pytest.raises(ConfigError,
                       match=r"unknown architecture 'resnet19' \(in 'resnet19:fc512'\); allowed: amazon_mlp, "):
        build_model("resnet19:fc512", num_classes=10)


def test_register_rejects_separator_and_duplicate_heads() -> None:
    with pytest.raises(ValueError, match="already registered"):
        @register_head("fc")
        def _again(feature_dim: int, num_classes: int) -> nn.Module:
            raise AssertionError("never called")
    with pytest.raises(ValueError, match="must not contain ':'"):
        @register_head("a:b")
        def _colon_head(feature_dim: int, num_classes: int) -> nn.Module:
            raise AssertionError("never called")
    with pytest.raises(ValueError, match="must not contain ':'"):
        @register_architecture("cnn:wide")
        def _colon_arch(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
            raise AssertionError("never called")
    with pytest.raises(ValueError, match="must not contain ','"):
        @register_architecture("cnn,wide")
        def _comma_arch(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
            raise AssertionError("never called")
    assert "a:b" not in heads() and "cnn:wide" not in architectures() and "cnn,wide" not in architectures()


# ---------------------------------------------------------------- model.init


def _initial(client_id, init, group="HtCNN8", seed=0):
    from htfl_dist.models import initial_client_model

    return initial_client_model(group, client_id, seed, num_classes=10, feature_dim=512, in_channels=1,
                                image_size=28, init=init)


def _same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_htfllib_init_is_the_reference_draw_order_for_htcnn1():
    """HtFLlib: torch.manual_seed(0), its CNN (conv, fc1, its own fc), then BaseHeadSplit draws a new
    Linear(512, 10) head; the CNN's own fc is thrown away. Written out layer by layer here."""
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 32, kernel_size=5)
    fc1 = nn.Linear(32 * 12 * 12, 512)
    nn.Linear(512, 10)  # the architecture's own classifier, drawn and discarded
    head = nn.Linear(512, 10)
    expected = [conv.weight, conv.bias, fc1.weight, fc1.bias, head.weight, head.bias]
    got = list(_initial(0, "htfllib").parameters())
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_htfllib_init_gives_equal_weights_to_clients_of_one_architecture():
    assert _same_weights(_initial(0, "htfllib"), _initial(8, "htfllib"))  # both htcnn1
    assert not _same_weights(_initial(0, "per_client"), _initial(8, "per_client"))
    # the seed still matters: HtFLlib's 0 is our seed 0
    assert not _same_weights(_initial(0, "htfllib"), _initial(0, "htfllib", seed=1))


def test_htfllib_init_draws_a_named_head_once_after_the_own_classifier():
    torch.manual_seed(3)
    expected = build_model("htcnn1:fc512", num_classes=10, feature_dim=512, in_channels=1, image_size=28)
    assert _same_weights(_initial(0, "htfllib", group="htcnn1:fc512", seed=3), expected)


def test_per_client_init_is_unchanged():
    from htfl_dist.seeding import seed_global_torch

    seed_global_torch(0, "init", 5)
    expected = build_model("htcnn6", num_classes=10, feature_dim=512, in_channels=1, image_size=28)
    assert _same_weights(_initial(5, "per_client"), expected)


def test_torchvision_is_imported_only_when_a_torchvision_architecture_is_built() -> None:
    """Every launched process would pay about 1.5 s for importing torchvision (it pulls in
    torch._dynamo); a run of HtCNN members must not, and a ResNet must still build."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import htfl_dist.main, htfl_dist.runtime.loop, htfl_dist.runtime.bootstrap\n"
        "from htfl_dist.models import build_model\n"
        "shape = dict(num_classes=10, feature_dim=16, in_channels=1, image_size=28)\n"
        "build_model('htcnn8', **shape)\n"
        "htfl_dist.runtime.bootstrap.software_versions()\n"
        "before = 'torchvision' in sys.modules\n"
        "build_model('resnet4', **shape)\n"
        "print(before, 'torchvision' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]


def test_a_plugin_registers_a_model_group_of_registered_members(monkeypatch):
    """register_model_group: members must name registered architectures (and heads); a name is
    taken once, and not by an architecture; the group then resolves like a built-in one."""
    from htfl_dist.models import register_model_group, registry

    monkeypatch.setattr(registry, "_MODEL_GROUPS", registry._MODEL_GROUPS.copy())  # undone after the test
    register_model_group("pair", ("htcnn1", "htcnn2:fc512"))
    assert [architecture_for_client("pair", i) for i in range(3)] == ["htcnn1", "htcnn2:fc512", "htcnn1"]
    with pytest.raises(ConfigError, match="unknown architecture 'nocnn' in model group 'broken'"):
        register_model_group("broken", ("htcnn1", "nocnn"))
    with pytest.raises(ValueError, match="model group 'pair' is already registered"):
        register_model_group("pair", ("htcnn1",))
    with pytest.raises(ValueError, match="clashes with an architecture name"):
        register_model_group("htcnn1", ("htcnn2",))
    assert "broken" not in registry.model_groups()
