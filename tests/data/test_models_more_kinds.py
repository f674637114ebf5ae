"""Sensor, text, tabular and ViT members, and HtFLlib's group names.

Widths are worked out by hand from the layer arithmetic (conv: (n - k) // s + 1; HtFLlib's
pool: kernel (1, 2) with stride 2 on both axes), features are recomputed from the modules'
own parameters with plain torch calls, and the group tables are spelled out as HtFLlib's
main.py lists them.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from htfl_dist.errors import ConfigError
from htfl_dist.models import (
    InputSpec,
    architecture_for_client,
    build_model,
    check_group_inputs,
    initial_client_model,
    model_groups,
    resolve_group,
    split_architecture,
)

HAR = InputSpec("image", (9, 1, 128))
PAMAP2 = InputSpec("image", (9, 3, 256))
TEXT = InputSpec("text", (12,), vocab_size=30)
AMAZON = InputSpec("tabular", (40,))


def _build(arch: str, inputs: InputSpec, feature_dim: int = 512, num_classes: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(arch, num_classes=num_classes, feature_dim=feature_dim, inputs=inputs).eval()


def _rows(tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([tokens, torch.tensor(lengths)[:, None]], dim=1)


# ---------------------------------------------------------------- sensor


# HAR 9 x 1 x 128. harcnn_s1: 128 -conv9-> 120 -pool-> 60 -conv9-> 52 -pool-> 26: 64 * 26 = 1664
# (HtFLlib's dim_hidden). s2: (128-9)//2+1 = 60 -> 30 -> 11 -> 5: 320. s3: 40 -> 20 -> 4 -> 2: 128.
# harcnn1 (one block of 32): 60, 30, 20 wide -> 1920, 960, 640. harcnn3 (kernel 5, 32/64/128):
# s1 124 -> 62 -> 58 -> 29 -> 25 -> 12: 1536; s2 62 -> 31 -> 14 -> 7 -> 2 -> 1: 128.
HAR_FLAT = {"harcnn_s1": 1664, "harcnn_s2": 320, "harcnn_s3": 128, "harcnn1_s1": 1920, "harcnn1_s2": 960,
            "harcnn1_s3": 640, "harcnn3_s1": 1536, "harcnn3_s2": 128}


@pytest.mark.parametrize("arch", sorted(HAR_FLAT))
def test_sensor_features_pool_the_flattened_convs_to_k(arch: str) -> None:
    model = _build(arch, HAR)
    x = torch.randn(3, 9, 1, 128)
    flat = model.feature_extractor.convs(x).flatten(1)
    assert flat.shape == (3, HAR_FLAT[arch])
    expected = F.adaptive_avg_pool1d(flat.unsqueeze(1), 512).squeeze(1)  # HtFLlib's AdaptiveAvgPool1d(K)
    torch.testing.assert_close(model.features(x), expected)
    assert model(x).shape == (3, 6)
    assert [type(m).__name__ for m in model.head.modules()] == ["Linear"]


def test_sensor_members_take_pamap2_windows_too() -> None:
    # height 3 -> conv 3 -> pool (3-1)//2+1 = 2 -> conv 2 -> pool 1; width 248 -> 124 -> 116 -> 58
    model = _build("harcnn_s1", PAMAP2)
    assert model.feature_extractor.fc.in_features == 64 * 1 * 58
    assert model.features(torch.randn(2, 9, 3, 256)).shape == (2, 512)


def test_sensor_group_refuses_pictures_and_image_group_refuses_windows() -> None:
    with pytest.raises(ConfigError) as info:
        check_group_inputs("HtFE-sen-2", 4, InputSpec.image(3, 32))
    assert str(info.value).startswith("model group 'HtFE-sen-2': member harcnn_s1 takes 9-channel sensor windows")
    assert "the data is 3 x 32 x 32 images" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"member cnn takes square images .* the data is 9 x 1 x 128 arrays"):
        check_group_inputs("HtFE-img-8", 8, HAR)
    with pytest.raises(ConfigError, match=r"member htcnn1 takes square images .* the data is text"):
        check_group_inputs("HtCNN8", 8, TEXT)
    check_group_inputs("HtFE-sen-8", 8, PAMAP2)  # fits: no error
    with pytest.raises(ConfigError, match=r"harcnn3_s2' needs longer windows than 9 x 1 x 16 arrays"):
        _build("harcnn3_s2", InputSpec("image", (9, 1, 16)))


# ---------------------------------------------------------------- text


def test_fasttext_features_are_log_softmax_of_fc1_of_the_mean_embedding() -> None:
    model = _build("fasttext", TEXT, feature_dim=16)
    tokens = torch.tensor([[2, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0], [2, 9, 9, 9, 4, 3, 1, 8, 8, 8, 8, 8]])
    extractor = model.feature_extractor
    assert torch.count_nonzero(extractor.embedding.weight[0]) == 0  # padding_idx 0
    mean = extractor.embedding.weight[tokens].sum(1) / 12  # every position counts, padding too
    expected = torch.log_softmax(mean @ extractor.fc1.weight.T + extractor.fc1.bias, dim=1)
    torch.testing.assert_close(model.features(_rows(tokens, [3, 12])), expected)
    # parameters: embedding V x K, fc1 K x K + K, head K x C + C
    assert sum(p.numel() for p in model.parameters()) == 30 * 16 + 16 * 16 + 16 + 16 * 6 + 6


@pytest.mark.parametrize("arch", ["fasttext", "text_logreg", "lstm", "gru"])
def test_log_softmax_features_exponentiate_to_one(arch: str) -> None:
    rows = _rows(torch.randint(1, 30, (4, 12)), [12, 3, 7, 1])
    features = _build(arch, TEXT, feature_dim=16).features(rows)
    torch.testing.assert_close(features.exp().sum(1), torch.ones(4))


def test_lstm_reads_the_last_padded_position_so_shorter_sequences_give_uniform_features() -> None:
    # HtFLlib's LSTMNet reads position L' - 1 of the padded output (L' the batch's longest length);
    # a shorter sequence has zeros there, ReLU(0) = 0, and log_softmax of K zeros is -log K.
    model = _build("lstm", TEXT, feature_dim=16)
    features = model.features(_rows(torch.randint(1, 30, (3, 12)), [10, 4, 10]))
    torch.testing.assert_close(features[1], torch.full((16,), -math.log(16)))
    assert not torch.allclose(features[0], torch.full((16,), -math.log(16)))


def test_gru_ignores_what_lies_past_each_length() -> None:
    model = _build("gru", TEXT, feature_dim=16)
    tokens = torch.randint(1, 30, (2, 12))
    changed = tokens.clone()
    changed[:, 5:] = torch.randint(1, 30, (2, 7))
    before, after = model.features(_rows(tokens, [5, 5])), model.features(_rows(changed, [5, 5]))
    torch.testing.assert_close(before, after)
    assert not torch.allclose(model.features(_rows(tokens, [12, 12])), model.features(_rows(changed, [12, 12])))


def test_transformer_reads_position_zero_and_attends_to_padding() -> None:
    model = _build("transformer_h4_l4", TEXT, feature_dim=16)
    tokens = torch.randint(1, 30, (2, 12))
    changed = tokens.clone()
    changed[:, -1] = (tokens[:, -1] % 29) + 1
    rows, moved = _rows(tokens, [3, 3]), _rows(changed, [3, 3])
    assert not torch.allclose(model.features(rows), model.features(moved))  # no padding mask
    encoder = model.feature_extractor
    embedded = encoder.embedding(tokens) * math.sqrt(16) + encoder.positions.table[:, :12]
    torch.testing.assert_close(model.features(rows), encoder.encoder(embedded)[:, 0])
    head = model.head  # the Transformer's own classifier init: uniform(-0.1, 0.1), bias 0
    assert head.weight.abs().max() <= 0.1 and torch.count_nonzero(head.bias) == 0
    with pytest.raises(ConfigError, match="not divisible by 16"):
        _build("transformer_h16_l4", TEXT, feature_dim=24)


def test_bilstm_reads_position_length_minus_one() -> None:
    model = _build("bilstm", TEXT, feature_dim=8)
    extractor = model.feature_extractor
    tokens = torch.randint(1, 30, (2, 12))
    output, _ = extractor.lstm(extractor.word_embeddings(tokens).permute(1, 0, 2))
    state = torch.stack([output[4, 0], output[11, 1]])  # lengths 5 and 12
    torch.testing.assert_close(model.features(_rows(tokens, [5, 12])), extractor.fc1(state))


def test_text_members_refuse_pictures_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("fasttext", num_classes=4, in_channels=1, image_size=28)
    assert str(info.value) == ("architecture 'fasttext' takes text (token ids and lengths, PFLlib's AG News "
                               "layout), not 1 x 28 x 28 images")


# ---------------------------------------------------------------- tabular


def test_amazon_mlp_features_pool_the_100_wide_encoder() -> None:
    model = _build("amazon_mlp_500", AMAZON, num_classes=2)
    layers = [m for m in model.feature_extractor if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in layers] == [(40, 500), (500, 100)]
    x = torch.rand(3, 40)
    encoded = torch.relu(layers[1](torch.relu(layers[0](x))))
    expected = F.adaptive_avg_pool1d(encoded.unsqueeze(1), 512).squeeze(1)
    torch.testing.assert_close(model.features(x), expected)
    plain = _build("amazon_mlp", AMAZON, feature_dim=100, num_classes=2)
    only = plain.feature_extractor[0]
    torch.testing.assert_close(plain.features(x), torch.relu(x @ only.weight.T + only.bias))  # K = 100: identity


# ---------------------------------------------------------------- ViT


def test_vit_members_have_htfllibs_tanh_head_and_need_divisible_sides() -> None:
    model = _build("vit_b_32", InputSpec.image(1, 32), num_classes=10)
    assert split_architecture("vit_b_32") == ("vit_b_32", "fc768_tanh")
    assert [type(m).__name__ for m in model.head] == ["Linear", "Tanh", "Linear"]
    assert (model.head[0].in_features, model.head[0].out_features, model.head[2].out_features) == (512, 768, 10)
    x = torch.randn(2, 1, 32, 32)
    assert model.features(x).shape == (2, 512) and model(x).shape == (2, 10)
    with pytest.raises(ConfigError, match="image_size 28 does not suit architecture 'vit_b_16'"):
        build_model("vit_b_16", num_classes=10, in_channels=1, image_size=28)
    fc_head = build_model("vit_b_32:fc", num_classes=10, in_channels=3, image_size=32)
    assert isinstance(fc_head.head, torch.nn.Linear)


# ---------------------------------------------------------------- groups


def test_htfllib_group_names_have_htfllibs_members() -> None:
    groups = model_groups()
    htfe8 = ("cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
    assert groups["HtFE-img-8"] == groups["HtFE8"] == htfe8
    assert groups["HtFE-img-2"] == ("cnn", "resnet18")
    assert groups["HtFE-img-5"] == ("googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50")
    assert groups["HtM-img-10"] == (*htfe8, "vit_b_16", "vit_b_32")
    # HtC-img-4: Head(hidden_dims=[512]) ... [512, 128], a ReLU after every FC layer
    assert groups["Res34-HtC-img-4"] == ("resnet34:fc_relu", "resnet34:fc512_relu", "resnet34:fc256_relu",
                                         "resnet34:fc128_relu")
    assert groups["HtFE-img-8-HtC-img-4"][5] == "resnet50:fc512_relu"
    assert groups["HtFE-sen-5"] == ("harcnn_s1", "harcnn_s2", "harcnn_s3", "harcnn1_s1", "harcnn3_s1")
    assert groups["HtFE-sen-8"][3:] == ("harcnn1_s1", "harcnn1_s2", "harcnn1_s3", "harcnn3_s1", "harcnn3_s2")
    assert groups["HtFE-txt-6"] == ("fasttext", "lstm", "bilstm", "transformer_h8_l2", "text_logreg", "gru")
    assert groups["HtFE-txt-5-1"] == ("transformer_h8_l1", "transformer_h8_l2", "transformer_h8_l4",
                                      "transformer_h8_l8", "transformer_h8_l16")
    assert groups["HtFE-txt-5-2"][0] == "transformer_h1_l4" and groups["HtFE-txt-5-3"][4] == "transformer_h16_l16"
    assert groups["MLPs"] == ("amazon_mlp", "amazon_mlp_500", "amazon_mlp_1000_500", "amazon_mlp_1000_500_200")
    assert groups["MLP_1layer"] == ("amazon_mlp_200", "amazon_mlp_500")
    assert architecture_for_client("HtFE-txt-2", 3) == "text_logreg"
    assert resolve_group("fasttext,gru") == ("fasttext", "gru")


def test_htfllib_init_gives_every_client_of_a_member_the_same_weights() -> None:
    first = initial_client_model("HtFE-txt-2", 0, 0, num_classes=4, feature_dim=16, init="htfllib", inputs=TEXT)
    third = initial_client_model("HtFE-txt-2", 2, 0, num_classes=4, feature_dim=16, init="htfllib", inputs=TEXT)
    other = initial_client_model("HtFE-txt-2", 2, 0, num_classes=4, feature_dim=16, inputs=TEXT)
    for a, b in zip(first.parameters(), third.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters(), strict=True))
