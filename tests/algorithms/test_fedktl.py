"""FedKTL: the client's simplex ETF and ArcFace loss, the shared h′ init, the pair batches, the
server's MMD / L^MSE / kernel helpers on examples worked out by hand; the server on a tiny real
generator (C pairs always, stale classes keep their centroid, MMD falls, same-class latents
contract); the client's loss, upload and inference rule; the server-side image adapter; the
options; and real runs: 1 process vs 3 torchrun ranks vs mpirun -n 3 stopped after round 1 and
resumed, the generated-image PNGs, the single-client mode (the paper's one-client experiment)."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from conftest import REPO, SMOKE, _env, launch, maths_only, read_metrics, run_smoke
from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms import fedktl as fedktl_module
from htfl_dist.algorithms import fedktl_server as fedktl_server_module
from htfl_dist.algorithms.fedktl import FedKTLClient, PairBatches, arcface_loss, auxiliary_projection, simplex_etf
from htfl_dist.algorithms.fedktl_server import (
    KERNEL_SIGMA2,
    FedKTLServer,
    in_graph_mse,
    kernel_bandwidths,
    kernel_saturation,
    mmd_loss,
    squared_distances,
)
from htfl_dist.config import TrainConfig, load_config
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.generators import to_client_images
from htfl_dist.generators.dcgan import PriorLatentGenerator
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

ENTRY = get_algorithm("fedktl")

# --------------------------------------------------------------------------- ETF


@pytest.mark.parametrize("num_classes,dim", [(10, 10), (3, 3), (3, 5)])
def test_simplex_etf_has_unit_columns_and_equal_negative_cosines(num_classes, dim):
    etf = simplex_etf(num_classes, dim, seed=0)
    assert etf.shape == (dim, num_classes) and etf.dtype == torch.float32
    gram = etf.t() @ etf  # columns unit: the Gram matrix is the cosine matrix
    # diagonal 1, off-diagonal −1/(C−1): −1/9 for C = 10, −1/2 for C = 3
    expected = torch.full((num_classes, num_classes), -1.0 / (num_classes - 1))
    expected.fill_diagonal_(1.0)
    torch.testing.assert_close(gram, expected, rtol=0, atol=1e-6)
    # the columns sum to 0 (a simplex centred at the origin)
    torch.testing.assert_close(etf.sum(dim=1), torch.zeros(dim), rtol=0, atol=1e-6)


def test_simplex_etf_is_a_function_of_the_seed():
    assert torch.equal(simplex_etf(10, 10, 3), simplex_etf(10, 10, 3))
    assert not torch.allclose(simplex_etf(10, 10, 3), simplex_etf(10, 10, 4), atol=1e-3)


def test_simplex_etf_needs_k_at_least_c():
    with pytest.raises(ConfigError, match="K >= C"):
        simplex_etf(10, 9, 0)


def _client_context(num_classes=3, feature_dim=8, latent_dim=5, image_size=4, batch_size=4, lr=0.0, seed=0,
                    **options):
    return AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=seed,
                            train=TrainConfig(batch_size=batch_size, lr=lr), options=parse_options(ENTRY, options),
                            in_channels=1, image_size=image_size, latent_dim=latent_dim)


def test_building_a_client_does_not_move_torchs_global_rng():
    context = _client_context(num_classes=10, feature_dim=512, latent_dim=100)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    client = FedKTLClient(context)
    assert torch.equal(torch.get_rng_state(), before)
    assert client.etf.shape == (10, 10)


# --------------------------------------------------------------------------- ArcFace

# The clamp: cos θ_y ≤ 1 − 1e-7, which float32 rounds to 1 − 1.19e-7, so an exactly aligned output
# has θ_y = arccos(1 − 1.19e-7) ≈ √(2·1.19e-7) ≈ 4.9e-4 rad instead of 0: the target logit is
# s·cos(0.5 + 4.9e-4) = s·(cos 0.5 − 4.9e-4·sin 0.5) ≈ s·(0.877583 − 0.000235). Tolerance 1e-4 abs.


def test_arcface_with_no_margin_and_unit_scale_is_a_softmax_over_cosines():
    etf = simplex_etf(4, 6, seed=1)
    outputs = torch.randn(7, 6, generator=torch.Generator().manual_seed(0)) * 3
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    cosines = (outputs / outputs.norm(dim=1, keepdim=True)) @ etf  # cos θ_c = ẑ·v_c (unit columns)
    expected = F.cross_entropy(cosines, labels)
    torch.testing.assert_close(arcface_loss(outputs, labels, etf, 1.0, 0.0), expected, rtol=1e-5, atol=1e-6)
    # scale only: CE over s·cos θ
    torch.testing.assert_close(arcface_loss(outputs, labels, etf, 4.0, 0.0), F.cross_entropy(4 * cosines, labels),
                               rtol=1e-5, atol=1e-6)


def test_arcface_aligned_output_by_hand():
    # V = I (columns e1, e2), z = (1, 0), y = 0, s = 2, m = 0.5: cos = (1, 0), θ_y ≈ 0
    # logits (2·cos 0.5, 2·0) = (1.755165, 0) → CE = log(1 + e^{−1.755165}) = log(1.172893) ≈ 0.15946
    loss = arcface_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), torch.eye(2), 2.0, 0.5)
    assert loss.item() == pytest.approx(0.15946, abs=1e-4)
    # the output's length is irrelevant (ẑ = z/‖z‖)
    assert arcface_loss(torch.tensor([[7.0, 0.0]]), torch.tensor([0]), torch.eye(2), 2.0, 0.5).item() == \
        pytest.approx(0.15946, abs=1e-4)


def test_arcface_sixty_degrees_by_hand():
    # z = (cos 60°, sin 60°) = (0.5, 0.866025), V = I, y = 0, s = 2, m = 0.5:
    #   θ_0 = 60° = 1.047198 rad → target logit 2·cos(1.047198 + 0.5) = 2·cos(1.547198) = 2·0.023596 = 0.047193
    #   other logit 2·cos θ_1 = 2·0.866025 = 1.732051
    #   CE = −log(e^{0.047193} / (e^{0.047193} + e^{1.732051})) = log(1 + e^{1.684858}) = log(6.391775) = 1.854998
    z = torch.tensor([[0.5, math.sqrt(3) / 2]])
    assert arcface_loss(z, torch.tensor([0]), torch.eye(2), 2.0, 0.5).item() == pytest.approx(1.854998, abs=1e-5)
    # label 1 instead: θ_1 = 30° → target 2·cos(0.523599 + 0.5) = 2·0.520296 = 1.040592; other 2·0.5 = 1
    #   CE = log(1 + e^{1 − 1.040592}) = log(1 + e^{−0.040592}) = 0.673057
    assert arcface_loss(z, torch.tensor([1]), torch.eye(2), 2.0, 0.5).item() == pytest.approx(0.673057, abs=1e-5)
    # margin 0, s = 2: log(1 + e^{2(0.866025 − 0.5)}) = log(1 + e^{0.732051}) = log(3.079492) = 1.124715
    assert arcface_loss(z, torch.tensor([0]), torch.eye(2), 2.0, 0.0).item() == pytest.approx(1.124715, abs=1e-5)


def test_arcface_gradient_is_finite_at_exact_alignment():
    etf = simplex_etf(3, 3, seed=0)
    outputs = (etf[:, 0] * 3).unsqueeze(0).clone().requires_grad_(True)  # exactly along v_0: cos θ_0 = 1
    arcface_loss(outputs, torch.tensor([0]), etf, 64.0, 0.5).backward()
    assert torch.isfinite(outputs.grad).all()


# --------------------------------------------------------------------------- h′ and the pair batches


def test_auxiliary_projection_is_shared_and_pytorch_default_ranged():
    first = FedKTLClient(_client_context(feature_dim=64, latent_dim=10))
    second = FedKTLClient(_client_context(feature_dim=64, latent_dim=10))  # as on another rank
    assert first.aux_init.weight.shape == (10, 64) and first.aux_init.bias.shape == (10,)
    assert torch.equal(first.aux_init.weight, second.aux_init.weight)
    assert torch.equal(first.aux_init.bias, second.aux_init.bias)
    bound = 1 / math.sqrt(64)  # U(±1/√K′) = ±0.125
    for tensor in (first.aux_init.weight, first.aux_init.bias):
        assert tensor.abs().max() <= bound
        assert tensor.abs().max() > 0.8 * bound  # spread over the range, not all ≈ 0
    # a function of the seed
    other = auxiliary_projection(64, 10, seed=1)
    assert not torch.equal(other.weight, first.aux_init.weight)


def test_pair_batches_paper_mode_uses_all_pairs_every_step():
    batches = PairBatches(7, None, torch.Generator().manual_seed(0))
    for _ in range(3):
        assert batches.next().tolist() == list(range(7))


def test_pair_batches_cycle_shuffled_mini_batches():
    batches = PairBatches(25, 10, torch.Generator().manual_seed(0))
    passes = []
    for _ in range(3):
        steps = [batches.next() for _ in range(3)]
        assert [len(s) for s in steps] == [10, 10, 5]
        order = torch.cat(steps)
        assert sorted(order.tolist()) == list(range(25))  # each index exactly once per pass
        passes.append(order.tolist())
    assert passes[0] != passes[1] and passes[1] != passes[2]  # a fresh shuffle each pass
    assert passes[0] != list(range(25))
    replay = PairBatches(25, 10, torch.Generator().manual_seed(0))
    assert torch.cat([replay.next() for _ in range(9)]).tolist() == [i for p in passes for i in p]
    different = PairBatches(25, 10, torch.Generator().manual_seed(1))
    assert torch.cat([different.next() for _ in range(3)]).tolist() != passes[0]


def test_pair_batches_drop_a_lone_last_pair():
    """C = 3 pairs, 2 per step: a pass is one batch of 2 and the third pair is left for the next
    shuffle (BatchNorm cannot train f_i on one generated image)."""
    batches = PairBatches(3, 2, torch.Generator().manual_seed(0))
    assert [len(batches.next()) for _ in range(6)] == [2] * 6


# --------------------------------------------------------------------------- server maths by hand


def test_in_graph_mse_by_hand():
    # class 0: (0,0), (2,0) → mean (1,0); per-pair MSE over H = 2: ((1² + 0²)/2) = 0.5 each → class 0: 0.5
    # class 1: (1,1) alone → 0; class 2 absent. L = (0.5 + 0)/2 = 0.25 (present classes)
    queries = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
    assert in_graph_mse(queries, torch.tensor([0, 0, 1]), 3).item() == pytest.approx(0.25, abs=1e-7)
    # class-balanced: 4 copies of the class-1 row still give (0.5 + 0)/2 (a pair-weighted mean: 1/6)
    queries = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert in_graph_mse(queries, torch.tensor([0, 0, 1, 1, 1, 1]), 3).item() == pytest.approx(0.25, abs=1e-7)
    # class 1 spread too: (1,1), (3,1) → mean (2,1), per pair (1 + 0)/2 = 0.5 → L = (0.5 + 0.5)/2 = 0.5
    queries = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 1.0], [3.0, 1.0]])
    assert in_graph_mse(queries, torch.tensor([0, 0, 1, 1]), 3).item() == pytest.approx(0.5, abs=1e-7)
    # row order does not matter
    assert in_graph_mse(queries[[3, 0, 2, 1]], torch.tensor([1, 0, 1, 0]), 3).item() == pytest.approx(0.5, abs=1e-7)


def test_mmd_by_hand():
    # x = [0], y = [√20]: K(x,x) = K(y,y) = 4 (four kernels, each e^0); ‖x − y‖² = 20:
    # K(x,y) = e^{−20/20} + e^{−20/30} + e^{−20/40} + e^{−20/100}
    #        = 0.367879 + 0.513417 + 0.606531 + 0.818731 = 2.306558
    # MMD = 4 + 4 − 2·2.306558 = 3.386884
    x, y = torch.tensor([[0.0]]), torch.tensor([[math.sqrt(20.0)]])
    assert KERNEL_SIGMA2 == (10.0, 15.0, 20.0, 50.0)
    assert mmd_loss(x, y, KERNEL_SIGMA2).item() == pytest.approx(3.386884, abs=1e-5)
    # two points each: x = {(0,0), (2,0)}, y = {(0,0), (0,2)}; one kernel σ² = 2 (k = e^{−d²/4}):
    #   K_xx: d² = [[0,4],[4,0]] → mean (2 + 2e^{−1})/4; K_yy the same;
    #   K_xy: d² = [[0,4],[4,8]] → mean (1 + 2e^{−1} + e^{−2})/4
    #   MMD = (2 + 2e^{−1})/2 − (1 + 2e^{−1} + e^{−2})/2 = (1 − e^{−2})/2 = 0.432332
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    y = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    assert mmd_loss(x, y, (2.0,)).item() == pytest.approx(0.432332, abs=1e-6)
    assert mmd_loss(x, x, KERNEL_SIGMA2).item() == pytest.approx(0.0, abs=1e-6)


def test_kernel_bandwidths_fixed_and_median():
    queries = torch.tensor([[0.0, 0.0]])
    latents = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    assert kernel_bandwidths(queries, latents, "fixed") == (10.0, 15.0, 20.0, 50.0)
    # ‖q − w‖² = 1, 4, 9 → median 4 → σ² of 20 becomes 4/2 = 2: every σ² × 0.1
    assert kernel_bandwidths(queries, latents, "median") == pytest.approx((1.0, 1.5, 2.0, 5.0), rel=1e-6)
    # and × 10 with everything √10 times farther: median 40 → 20 stays 20
    assert kernel_bandwidths(queries, latents * math.sqrt(10), "median") == pytest.approx((10, 15, 20, 50), rel=1e-5)


def test_kernel_saturation():
    q = torch.tensor([[0.0]])
    assert kernel_saturation(q, torch.tensor([[1000.0]]), KERNEL_SIGMA2) == 1.0  # d² = 1e6: every k ≈ 0
    assert kernel_saturation(q, torch.tensor([[0.0]]), KERNEL_SIGMA2) == 1.0  # d² = 0: every k = 1
    # d² = 20: k = 0.37, 0.51, 0.61, 0.82, all inside (1e-3, 1 − 1e-3)
    assert kernel_saturation(q, torch.tensor([[math.sqrt(20.0)]]), KERNEL_SIGMA2) == 0.0
    # half the cross pairs far, half mid: 0.5
    assert kernel_saturation(q, torch.tensor([[1000.0], [math.sqrt(20.0)]]), KERNEL_SIGMA2) == pytest.approx(0.5)


# --------------------------------------------------------------------------- server on a tiny generator

C, H = 4, 16


def _tiny_generator() -> PriorLatentGenerator:
    """z ∈ R^16 → ConvTranspose(16→3, 16×16 kernel) on a 1×1 map → Tanh: 3×16×16 in [−1, 1]."""
    module = nn.Sequential(nn.Unflatten(1, (H, 1, 1)), nn.ConvTranspose2d(H, 3, 16), nn.Tanh())
    with torch.no_grad():
        module[1].weight.copy_(torch.randn(module[1].weight.shape, generator=torch.Generator().manual_seed(5)) * 0.3)
    return PriorLatentGenerator("tiny", module, H, channels=3, resolution=16, provenance={})


def _server_context(**options) -> AlgorithmContext:
    return AlgorithmContext(num_classes=C, feature_dim=8, seed=0, train=TrainConfig(batch_size=10),
                            options=parse_options(ENTRY, options), in_channels=1, image_size=8, latent_dim=H)


def _server(**options) -> FedKTLServer:
    context = _server_context(**options)
    torch.manual_seed(0)
    return FedKTLServer(context, generator=_tiny_generator())


def _uploads(classes=((0, 1, 2, 3),) * 3, seed=1) -> dict:
    """Random unit prototypes in R^C, one per (client, class)."""
    generator = torch.Generator().manual_seed(seed)
    uploads = {}
    for client, held in enumerate(classes):
        rows = F.normalize(torch.randn(len(held), C, generator=generator), dim=1)
        uploads[client] = {"class_ids": torch.tensor(held), "protos": rows}
    return uploads


def _pairs(uploads):
    return (torch.cat([u["protos"] for u in uploads.values()]), torch.cat([u["class_ids"] for u in uploads.values()]))


@torch.no_grad()
def _eval_queries(server, protos):
    server.transformer.eval()
    return server.transformer(protos)


def test_server_download_before_and_after_updates():
    server = _server(server_epochs=3)
    empty = server.download()
    assert [empty[k].shape[0] for k in ("class_ids", "images", "latents")] == [0, 0, 0]
    assert empty["images"].shape[1:] == (1, 8, 8) and empty["latents"].shape[1:] == (H,)
    assert server.theory_download_floats() == C * (1 * 8 * 8 + H)  # 4·80 = 320

    initial = server.centroids.clone()
    uploads = _uploads(classes=((0, 1), (1, 2), (0, 2)))  # nobody holds class 3
    result = server.update(uploads, 0, torch_generator(0, "server", 0))
    assert result["server_pairs"] == 6 and result["stale_classes"] == 1
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1, 2, 3]  # all C pairs, the stale class too
    assert download["images"].shape == (C, 1, 8, 8) and download["latents"].shape == (C, H)
    assert download["images"].min() >= -1 and download["images"].max() <= 1
    assert torch.equal(download["latents"][3], initial[3])  # class 3 keeps its N(0, 1) start
    # the present classes: Q^c = mean of F_eval(P_i^c) over this round's uploads
    protos, labels = _pairs(uploads)
    queries = _eval_queries(server, protos)
    for c in range(3):
        torch.testing.assert_close(download["latents"][c], queries[labels == c].mean(0), rtol=1e-5, atol=1e-6)
    # I^c = G(Q^c), at the clients' shape
    expected_images = to_client_images(server.generator.synthesize(download["latents"]), 8, 1)
    torch.testing.assert_close(download["images"], expected_images, rtol=0, atol=1e-6)

    # a round without class 0: it keeps the centroid from the last round
    before = download["latents"].clone()
    server.update(_uploads(classes=((1, 2, 3), (1, 3)), seed=2), 1, torch_generator(0, "server", 1))
    after = server.download()["latents"]
    assert torch.equal(after[0], before[0])
    assert not torch.allclose(after[3], before[3])  # now uploaded: class 3 moves
    assert after.shape == (C, H)


def test_server_mmd_falls_over_the_server_epochs():
    server = _server(use_mse=False, server_epochs=50)
    uploads = _uploads()  # 12 unit prototypes, 3 per class
    protos, _ = _pairs(uploads)
    target = server.generator.sample_latents(512, torch.Generator().manual_seed(7))
    before = float(mmd_loss(_eval_queries(server, protos), target, KERNEL_SIGMA2))
    server.update(uploads, 0, torch_generator(0, "server", 0))
    after = float(mmd_loss(_eval_queries(server, protos), target, KERNEL_SIGMA2))
    assert after < 0.5 * before, (before, after)


@pytest.mark.parametrize("options", [{"use_mmd": False}, {"use_mmd": False, "compat": "reference"}])
def test_same_class_latents_contract_under_the_mse_term(options):
    server = _server(server_epochs=50, **options)
    assert server.options.centroid_target == ("table" if options.get("compat") == "reference" else "in_graph")
    uploads = _uploads()
    protos, labels = _pairs(uploads)
    before = float(in_graph_mse(_eval_queries(server, protos), labels, C))
    result = server.update(uploads, 0, torch_generator(0, "server", 0))
    after = float(in_graph_mse(_eval_queries(server, protos), labels, C))
    assert after < 0.2 * before, (before, after)
    assert result["mse"] == pytest.approx(after, rel=1e-5)


def test_a_single_uploaded_prototype_does_not_crash_and_gives_c_pairs():
    server = _server()
    result = server.update({0: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[0.0, 0.0, 1.0, 0.0]])}},
                           0, torch_generator(0, "server", 0))
    assert result["server_pairs"] == 1 and result["stale_classes"] == 3
    assert server.download()["class_ids"].tolist() == [0, 1, 2, 3]
    assert server.download()["images"].shape == (C, 1, 8, 8)


def test_server_is_independent_of_arrival_order():
    uploads = _uploads()
    forward, backward = _server(server_epochs=5), _server(server_epochs=5)
    a = forward.update(dict(uploads), 0, torch_generator(0, "server", 0))
    b = backward.update(dict(reversed(list(uploads.items()))), 0, torch_generator(0, "server", 0))
    assert a == b
    assert torch.equal(forward.download()["latents"], backward.download()["latents"])


# --------------------------------------------------------------------------- client


def _tiny_client(lr=0.0, seed=0) -> ClientState:
    """1×4×4 images → Flatten → Linear(16, 8) → ReLU (K′ = 8) → head Linear(8, 3) (K = C = 3).
    12 samples of classes 0 and 2 only."""
    torch.manual_seed(seed)
    model = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU()), nn.Linear(8, 3), feature_dim=8)
    x = torch.randn(12, 1, 4, 4, generator=torch.Generator().manual_seed(seed + 100))
    y = torch.tensor([0, 2] * 6)
    return ClientState(0, "tiny", model, torch.optim.SGD(model.parameters(), lr=lr), x, y, x, y, torch.device("cpu"))


def _empty_download(context):
    return {f.name: torch.empty(0, *f.trailing_shape, dtype=f.dtype) for f in FedKTLServer.download_fields(context)}


def _pairs_download(seed=3):
    generator = torch.Generator().manual_seed(seed)
    return {"class_ids": torch.arange(3), "images": torch.rand(3, 1, 4, 4, generator=generator) * 2 - 1,
            "latents": torch.randn(3, 5, generator=generator)}


def test_client_loss_is_arcface_plus_mu_times_the_pair_mse():
    """lr = 0: nothing moves, so the mean loss is ArcFace on the whole split (batch means weighted
    by batch size) plus μ·MSE(h′(f(I)), Q) over all C pairs (paper mode: every step sees them all)."""
    context = _client_context(mu=50.0)
    algorithm = FedKTLClient(context)
    client = _tiny_client()
    with torch.no_grad():
        arcface = float(arcface_loss(client.model(client.train_x), client.train_y, algorithm.etf, 64.0, 0.5))
        pairs = _pairs_download()
        transfer = float(F.mse_loss(algorithm.aux_init(client.model.features(pairs["images"])), pairs["latents"]))
    result = algorithm.train(client, pairs, 1, torch_generator(0, "b"))
    assert result.samples == 12
    assert result.loss_sum / result.samples == pytest.approx(arcface + 50.0 * transfer, rel=1e-5)
    empty = algorithm.train(_tiny_client(), _empty_download(context), 0, torch_generator(0, "b"))
    assert empty.loss_sum / empty.samples == pytest.approx(arcface, rel=1e-5)  # round 1: ArcFace only


def _trained_parameters(mu, knowledge, **options):
    context = _client_context(lr=0.05, mu=mu, **options)
    client = _tiny_client(lr=0.05)
    FedKTLClient(context).train(client, knowledge, 0, torch_generator(0, "b"))
    return [p.detach().clone() for p in client.model.parameters()]


def test_round_one_trains_with_arcface_only_and_later_rounds_use_the_pairs():
    empty = _empty_download(_client_context())
    without = _trained_parameters(0.0, empty)
    with_mu = _trained_parameters(50.0, empty)
    assert all(torch.equal(a, b) for a, b in zip(without, with_mu, strict=True))
    pairs = _pairs_download()
    zero = _trained_parameters(0.0, pairs)
    assert all(torch.equal(a, b) for a, b in zip(zero, without, strict=True))  # μ = 0: the pairs are ignored
    transfer = _trained_parameters(50.0, pairs)
    assert not all(torch.equal(a, b) for a, b in zip(zero, transfer, strict=True))
    initial = [p.detach() for p in _tiny_client().model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(initial, without, strict=True))  # it did train


def test_upload_is_one_unit_prototype_per_held_class():
    context = _client_context(lr=0.05, unit_prototypes=True)
    algorithm = FedKTLClient(context)
    client = _tiny_client(lr=0.05)
    result = algorithm.train(client, _pairs_download(), 1, torch_generator(0, "b"))
    class_ids, protos = result.upload["class_ids"], result.upload["protos"]
    assert class_ids.tolist() == [0, 2] and protos.shape == (2, 3)
    torch.testing.assert_close(protos.norm(dim=1), torch.ones(2), rtol=0, atol=1e-5)
    # by definition: normalise(mean over the class of normalise(g(x))), eval mode, after training
    with torch.no_grad():
        client.model.eval()
        unit = F.normalize(client.model(client.train_x), dim=1)
    for row, c in enumerate((0, 2)):
        mean = unit[client.train_y == c].mean(0)
        torch.testing.assert_close(protos[row], mean / mean.norm(), rtol=1e-5, atol=1e-6)
    assert algorithm.theory_upload_floats(client) == 3 * 2  # K·|C_i| with K = C


def test_auxiliary_projection_restarts_from_the_same_state_every_round():
    context = _client_context(lr=0.05)
    algorithm = FedKTLClient(context)
    init = copy.deepcopy(algorithm.aux_init.state_dict())
    client = _tiny_client(lr=0.05)
    model_state = copy.deepcopy(client.model.state_dict())
    first = algorithm.train(client, _pairs_download(), 1, torch_generator(0, "b", 1))
    second = algorithm.train(client, _pairs_download(seed=4), 2, torch_generator(0, "b", 2))
    assert all(torch.equal(init[k], v) for k, v in algorithm.aux_init.state_dict().items())
    # a second client, and the first again from its round-1 state: the same result (h′ was not kept)
    other = _tiny_client(lr=0.05, seed=9)
    algorithm.train(other, _pairs_download(), 1, torch_generator(0, "b", 1))
    client.model.load_state_dict(model_state)
    again = algorithm.train(client, _pairs_download(), 1, torch_generator(0, "b", 1))
    assert torch.equal(again.upload["protos"], first.upload["protos"])
    assert not torch.equal(second.upload["protos"], first.upload["protos"])
    assert all(torch.equal(init[k], v) for k, v in algorithm.aux_init.state_dict().items())


def test_prediction_is_the_argmax_of_cosines_to_the_etf_columns():
    algorithm = FedKTLClient(_client_context(num_classes=2, feature_dim=4, latent_dim=3))
    # a 2-class ETF in R^2 is ±v: v = (0.6, 0.8)
    algorithm.etf = torch.tensor([[0.6, -0.6], [0.8, -0.8]])
    logits = torch.tensor([[1.0, 0.0],  # cos with v = 0.6 > −0.6 → 0
                           [0.0, 1.0],  # raw argmax 1, but cos with v = 0.8 → 0
                           [-1.0, 0.1],  # v·z = −0.52 < 0 → 1
                           [-30.0, 20.0]])  # v·z = −18 + 16 = −2 → 1
    predicted = algorithm.predict(_tiny_client(), {}, torch.zeros(4, 4), logits)
    assert predicted.tolist() == [0, 0, 1, 1]
    # with a real C = 3 ETF: an output along v_c is classified c, whatever its length
    algorithm = FedKTLClient(_client_context())
    outputs = torch.stack([algorithm.etf[:, 2] * 5, algorithm.etf[:, 0] * 0.1, algorithm.etf[:, 1]])
    assert algorithm.predict(_tiny_client(), {}, torch.zeros(3, 8), outputs).tolist() == [2, 0, 1]


@pytest.mark.parametrize("options,size", [({}, None), ({"compat": "reference"}, 4), ({"pairs_per_step": 2}, 2),
                                          ({"compat": "reference", "pairs_per_step": 2}, 2)])
def test_pairs_per_step(monkeypatch, options, size):
    sizes = []

    class Spy(PairBatches):
        def __init__(self, count, size, generator):
            sizes.append((count, size))
            super().__init__(count, size, generator)

    monkeypatch.setattr(fedktl_module, "PairBatches", Spy)
    context = _client_context(batch_size=4, **options)
    FedKTLClient(context).train(_tiny_client(), _pairs_download(), 1, torch_generator(0, "b"))
    assert sizes == [(3, size)]


def _batchnorm_client() -> ClientState:
    """As ``_tiny_client`` with a BatchNorm1d in f_i (as the torchvision models' last BN on 1×1 maps):
    a training-mode batch of one generated image cannot go through it."""
    client = _tiny_client(lr=0.05)
    torch.manual_seed(0)
    client.model = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU()),
                              nn.Linear(8, 3), feature_dim=8)
    client.optimizer = torch.optim.SGD(client.model.parameters(), lr=0.05)
    return client


def test_batchnorm_extractors_train_on_the_pairs():
    """Paper mode: every step sees all C = 3 pairs, so f_i's BatchNorm always has > 1 image."""
    context = _client_context(lr=0.05)
    result = FedKTLClient(context).train(_batchnorm_client(), _pairs_download(), 1, torch_generator(0, "b"))
    assert torch.isfinite(result.upload["protos"]).all()


def test_generated_images_go_through_the_client_model_in_train_mode():
    """f_i = Flatten → BatchNorm1d(16, momentum=None, affine=False): in train mode BN keeps the
    plain average of every batch mean it sees. lr = 0, 12 samples in 3 batches of 4, all C = 3
    images at each step: 3 data batches + 3 image batches, so running_mean = (mean of the 3 data
    batch means + 3 × the images' mean) / 6 = (data mean + image mean) / 2, and 6 batches tracked.
    Had the images gone through in eval mode, BN would have seen the data alone (the data mean,
    3 batches)."""
    client = _tiny_client()
    norm = nn.BatchNorm1d(16, momentum=None, affine=False)
    client.model = SplitModel(nn.Sequential(nn.Flatten(), norm), nn.Linear(16, 3), feature_dim=16)
    client.optimizer = torch.optim.SGD(client.model.parameters(), lr=0.0)
    pairs = _pairs_download()
    FedKTLClient(_client_context(feature_dim=16, mu=50.0)).train(client, pairs, 1, torch_generator(0, "b"))
    data_mean = client.train_x.flatten(1).mean(0)
    image_mean = pairs["images"].flatten(1).mean(0)
    assert int(norm.num_batches_tracked) == 6
    torch.testing.assert_close(norm.running_mean, (data_mean + image_mean) / 2, rtol=1e-5, atol=1e-6)


def test_a_trailing_single_pair_does_not_break_batchnorm():
    context = _client_context(lr=0.05, pairs_per_step=2)  # C = 3 pairs per pass: steps of 2, then 1
    result = FedKTLClient(context).train(_batchnorm_client(), _pairs_download(), 1, torch_generator(0, "b"))
    assert torch.isfinite(result.upload["protos"]).all()


def test_a_real_client_uploads_unit_prototypes(tmp_path, cache_dir):
    from htfl_dist.runtime.session import RunContext, Session
    from htfl_dist.runtime.transport import LocalTransport

    config = load_config(SMOKE, ["algorithm=fedktl", f"data.cache_dir={cache_dir}", "rounds=2",
                                 "algo.unit_prototypes=true"])
    session = Session(RunContext(config, LocalTransport(), torch.device("cpu"), tmp_path))
    algorithm, context = session.client_algorithm, session.context
    assert (context.latent_dim, context.in_channels, context.image_size) == (100, 1, 28)
    assert algorithm.aux_init.weight.shape == (100, 512)  # h′ = Linear(K′, H)
    assert algorithm.aux_init.weight.abs().max() <= 1 / math.sqrt(512)
    client = session.clients[0]
    init = copy.deepcopy(algorithm.aux_init.state_dict())
    result = algorithm.train(client, session.server.download(), 0, torch_generator(0, "batches", 0, 0))
    assert result.upload["class_ids"].tolist() == client.classes.tolist()
    assert result.upload["protos"].shape == (client.classes.numel(), 10)
    torch.testing.assert_close(result.upload["protos"].norm(dim=1), torch.ones(client.classes.numel()),
                               rtol=0, atol=1e-5)
    session.server.update({0: result.upload}, 0, torch_generator(0, "server", 0))
    download = session.server.download()
    assert download["images"].shape == (10, 1, 28, 28) and download["latents"].shape == (10, 100)
    algorithm.train(client, download, 1, torch_generator(0, "batches", 0, 1))
    assert all(torch.equal(init[k], v) for k, v in algorithm.aux_init.state_dict().items())


# --------------------------------------------------------------------------- image adapter


def test_to_client_images_colours():
    grey = torch.zeros(1, 3, 28, 28)  # pixel 0.5 everywhere
    torch.testing.assert_close(to_client_images(grey, 28, 1), torch.zeros(1, 1, 28, 28), rtol=0, atol=1e-6)
    red = torch.tensor([1.0, -1.0, -1.0]).view(1, 3, 1, 1).expand(1, 3, 28, 28)  # RGB (1, 0, 0)
    # luma 0.299·1 + 0.587·0 + 0.114·0 = 0.299 → (0.299 − 0.5)/0.5 = −0.402
    torch.testing.assert_close(to_client_images(red, 28, 1), torch.full((1, 1, 28, 28), -0.402), rtol=0, atol=1e-6)
    # out-of-range pixels are clamped to [0, 1] first: 3.0 → 1 → +1
    torch.testing.assert_close(to_client_images(torch.full((1, 1, 4, 4), 3.0), 4, 1), torch.ones(1, 1, 4, 4))
    # grey → RGB repeats the channel: −0.5 ↦ pixel 0.25 ↦ −0.5 in all three
    out = to_client_images(torch.full((2, 1, 8, 8), -0.5), 8, 3)
    torch.testing.assert_close(out, torch.full((2, 3, 8, 8), -0.5))


def test_to_client_images_resizes_and_centre_crops():
    out = to_client_images(torch.rand(2, 3, 64, 64) * 2 - 1, 28, 1)
    assert out.shape == (2, 1, 28, 28) and out.min() >= -1 and out.max() <= 1
    # 3×16×32 at 16: no resize; the centre crop keeps columns 8..23. Left half −1, right half +1:
    # the crop's left 8 columns are −1, its right 8 are +1
    halves = torch.cat([torch.full((1, 3, 16, 16), -1.0), torch.full((1, 3, 16, 16), 1.0)], dim=3)
    out = to_client_images(halves, 16, 3)
    assert out.shape == (1, 3, 16, 16)
    torch.testing.assert_close(out[..., :8], torch.full((1, 3, 16, 8), -1.0))
    torch.testing.assert_close(out[..., 8:], torch.full((1, 3, 16, 8), 1.0))
    # 3 stripes of 3×32×64 (16 | 32 | 16 columns) at 16: resized to 16×32 (stripes 8 | 16 | 8), crop = the middle
    stripes = torch.full((1, 3, 32, 64), 0.0)
    stripes[..., :16], stripes[..., 48:] = -1.0, 1.0
    out = to_client_images(stripes, 16, 3)
    assert out.shape == (1, 3, 16, 16)
    torch.testing.assert_close(out[..., 2:14], torch.zeros(1, 3, 16, 12), rtol=0, atol=1e-5)
    assert out.abs().max() < 0.5  # the −1 / +1 stripes were cropped away (at most blurred into the edges)
    # tall images crop rows: 3×32×16 at 16 keeps rows 8..23
    tall = torch.cat([torch.full((1, 1, 8, 16), -1.0), torch.full((1, 1, 16, 16), 0.0),
                      torch.full((1, 1, 8, 16), 1.0)], dim=2)
    torch.testing.assert_close(to_client_images(tall, 16, 1), torch.zeros(1, 1, 16, 16))


# --------------------------------------------------------------------------- options


def test_paper_defaults_and_htfllib_values():
    o = parse_options(ENTRY, {})
    assert (o.mu, o.mse_weight, o.arcface_scale, o.arcface_margin) == (50.0, 1.0, 64.0, 0.5)
    assert (o.server_lr, o.server_epochs, o.server_batch_size) == (0.01, 100, 100)
    assert (o.mmd_bandwidth, o.centroid_target, o.pairs_per_step) == ("fixed", "in_graph", None)
    assert o.unit_prototypes is False  # the paper's P_i^c = E g_i(x)
    o = parse_options(ENTRY, {"compat": "reference"})
    assert (o.centroid_target, o.pairs_per_step) == ("table", None)  # None + htfllib: train.batch_size
    assert o.unit_prototypes is True  # the code's normalised mean of normalised outputs
    o = parse_options(ENTRY, {"compat": "reference", "centroid_target": "in_graph", "unit_prototypes": False})
    assert (o.centroid_target, o.unit_prototypes) == ("in_graph", False)  # an explicit knob wins


@pytest.mark.parametrize("options,key", [
    ({"mu": -1.0}, "algo.mu"),
    ({"server_epochs": 0}, "algo.server_epochs"),
    ({"server_batch_size": 0}, "algo.server_batch_size"),
    ({"pairs_per_step": 0}, "algo.pairs_per_step"),
    ({"mmd_bandwidth": "foo"}, "algo.mmd_bandwidth"),
    ({"centroid_target": "foo"}, "algo.centroid_target"),
    ({"compat": "fedml"}, "algo.compat"),
    ({"arcface_scale": 0.0}, "algo.arcface_scale"),
    ({"server_lr": 0.0}, "algo.server_lr"),
    ({"arcface_margin": -0.1}, "algo.arcface_margin"),
])
def test_bad_options_are_one_line_errors(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        parse_options(ENTRY, options)
    assert "\n" not in str(error.value)


@pytest.mark.launch
def test_bad_option_on_the_command_line_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "htfl_dist.main", "--config", str(SMOKE), "--out",
                             str(tmp_path / "run"), "algorithm=fedktl", "algo.mu=-1"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "algo.mu" in lines[0], result.stderr


# --------------------------------------------------------------------------- real runs

RUN = ("algorithm=fedktl", "rounds=2")


def _run(launcher, nproc, out, cache_dir, *overrides):
    return run_smoke(launcher, nproc, out, cache_dir, *RUN, *overrides)


@pytest.fixture(scope="module")
def single_out(single_run):
    """The session's one-process run of RUN (the conformance test compares the same with 3 ranks)."""
    return single_run(*RUN)[0]


@pytest.fixture(scope="module")
def single(single_run):
    return single_run(*RUN)[1]


def test_real_run_rows(single, cache_dir):
    from htfl_dist.data import prepare_partition

    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", *RUN])
    counts = prepare_partition(config.data, config.num_clients, config.seed).class_counts
    held = int(np.count_nonzero(counts))  # Σ|C_i|
    num_classes = counts.shape[1]
    assert num_classes == 10 and config.num_clients == 6
    assert [r["round"] for r in single] == [1, 2]
    for row in single:
        assert row["bytes_theory_up"] == 4 * num_classes * held
        assert row["bytes_theory_down"] == 4 * 6 * num_classes * (28 * 28 + 100)  # 212 160
        assert row["server_pairs"] == held and row["stale_classes"] == int((counts.sum(0) == 0).sum())
        assert 0.0 <= row["mmd_kernel_saturation"] <= 1.0
        assert row["centroid_min_dist"] > 0 and row["mse"] >= 0 and math.isfinite(row["mmd"])
        assert math.isfinite(row["server_loss"])
        assert row["test_acc"] > 0.3  # 10 classes, chance 0.1
        assert row["test_acc_head"] == row["test_acc"]  # the ETF is the clients' own classifier


def test_real_run_summary_and_generated_images(single_out):
    summary = json.loads((single_out / "summary.json").read_text())
    assert summary["generator"]["name"] == "dcgan_faces"
    assert summary["generator"]["sha256"].startswith("0c3b90b1")
    for round_number in (1, 2):
        path = single_out / "generated" / f"round_{round_number:05d}.png"
        with Image.open(path) as picture:
            picture.load()
            # 10 tiles of 28 px zoomed ×2 (to ≥ 56 px) in one row, 2 px gaps: 10·56 + 9·2 = 578 × 56, grey
            assert picture.size == (578, 56) and picture.mode == "L"
            pixels = np.asarray(picture)
        tiles = [pixels[:, i * 58 : i * 58 + 56] for i in range(10)]
        assert len({tile.tobytes() for tile in tiles}) > 1  # the C class images are not all the same


@pytest.mark.launch
def test_mpirun_three_ranks_and_a_resume_equal_one_uninterrupted_process(single, tmp_path, cache_dir):
    """Round 1 on mpirun -n 3 with a checkpoint, then round 2 resumed from it: the same rows as one
    process running both rounds (F with its BN statistics, the centroids and the pairs come back)."""
    first = _run("mpirun", 3, tmp_path, cache_dir, "rounds=1", "checkpoint_every=1")
    assert maths_only(first) == maths_only(single[:1])
    resumed = launch("mpirun", 3, ["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                                   *RUN, "checkpoint_every=1", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert maths_only(read_metrics(tmp_path)) == maths_only(single)


@pytest.mark.integration
def test_single_client_mode(tmp_path, cache_dir):
    """One server, one client; one local epoch per round, so the loop runs once per epoch."""
    rows = _run("single", 1, tmp_path, cache_dir, "num_clients=1")
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["bytes_theory_down"] == 4 * 1 * 10 * (28 * 28 + 100)
        assert row["server_pairs"] == row["bytes_theory_up"] // (4 * 10)
        assert 0 < row["test_acc"] <= 1


# ------------------------------------------------------ edges found by a mutmut pass (issue 12)


def test_option_bounds_accept_their_edge_values():
    """server_epochs, server_batch_size and pairs_per_step must be >= 1: 1 itself is allowed."""
    o = parse_options(ENTRY, {"server_epochs": 1, "server_batch_size": 1, "pairs_per_step": 1})
    assert (o.server_epochs, o.server_batch_size, o.pairs_per_step) == (1, 1, 1)


def test_simplex_etf_needs_two_classes_exact_message():
    with pytest.raises(ConfigError, match=r"^FedKTL's ETF classifier needs at least 2 classes$"):
        simplex_etf(1, 1, 0)  # K = C = 1 passes the K >= C check, then fails this one


@pytest.mark.parametrize("num_classes,dim", [(3, 5), (4, 7)])
def test_simplex_etf_lies_in_the_span_of_its_documented_stream(num_classes, dim):
    """V = sqrt(C/(C−1)) · U · (I − 11ᵀ/C) with U the Q of a QR of D = U[0, 1)^{K×C} drawn from stream
    (seed, "fedktl-etf"): every column of V is a combination of U's columns, hence of D's. For K > C
    that span is a proper subspace of R^K, so the projection of V onto span(D) must give V back;
    a C-dim subspace drawn from another stream does not contain V (the second check)."""
    etf = simplex_etf(num_classes, dim, seed=2).double()

    def residual(stream: str) -> float:
        draw = torch.rand(dim, num_classes, generator=torch_generator(2, stream), dtype=torch.float64)
        projector = draw @ torch.linalg.solve(draw.t() @ draw, draw.t())  # onto span(D)
        return float((etf - projector @ etf).abs().max())

    assert residual("fedktl-etf") < 1e-6
    assert residual("fedktl-aux") > 1e-2


def test_arcface_gradient_is_finite_at_exact_opposition():
    """cos θ_y = −1 exactly (z = −v_y): arccos' is infinite at −1, so the clamp at −1 + ε must hold
    it off. V = I, z = (−1, 0), y = 0, s = 2, m = 0.5: float32 rounds −1 + 1e-7 to −1 + 1.19e-7, θ_y =
    arccos(−1 + 1.19e-7) = π − 4.88e-4 = 3.141104; target logit 2·cos(3.141104 + 0.5) = −1.755633,
    other 2·0 = 0; CE = log(1 + e^{1.755633}) = log(6.786992) = 1.915025."""
    outputs = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    loss = arcface_loss(outputs, torch.tensor([0]), torch.eye(2), 2.0, 0.5)
    assert loss.item() == pytest.approx(1.915025, abs=2e-5)
    loss.backward()
    assert torch.isfinite(outputs.grad).all()


def test_auxiliary_projection_is_the_documented_affine_map_of_its_stream():
    """U(±b) with b = 1/√K′ is u ↦ 2b·u − b of U[0, 1) draws u from stream (seed, "fedktl-aux"),
    weight first (row-major), then bias: (w + b)/(2b) gives those draws back. K′ = 16: b = 0.25;
    both signs occur (a map onto [−b, −b/2) would pass a |w| <= b check)."""
    layer = auxiliary_projection(16, 6, seed=5)
    stream = torch_generator(5, "fedktl-aux")
    draws = torch.rand(6 * 16 + 6, generator=stream)
    bound = 0.25
    torch.testing.assert_close((layer.weight.detach() + bound) / (2 * bound), draws[:96].view(6, 16))
    torch.testing.assert_close((layer.bias.detach() + bound) / (2 * bound), draws[96:])
    assert layer.weight.min() < -0.8 * bound and layer.weight.max() > 0.8 * bound


def test_pair_batches_use_an_exact_pair_of_leftovers_before_reshuffling():
    """C = 4, 2 per step: after the first step 2 pairs remain, a full batch, so they are used;
    each two steps are a permutation of the 4 pairs."""
    batches = PairBatches(4, 2, torch.Generator().manual_seed(0))
    passes = [torch.cat([batches.next(), batches.next()]).tolist() for _ in range(5)]
    for order in passes:
        assert sorted(order) == [0, 1, 2, 3]
    assert len({tuple(p) for p in passes}) > 1  # reshuffled between passes


def test_pair_batches_with_no_pairs_or_one_pair():
    empty = PairBatches(0, 2, torch.Generator().manual_seed(0)).next()
    assert empty.dtype == torch.int64 and empty.numel() == 0  # an index usable on an empty tensor
    single = PairBatches(1, 2, torch.Generator().manual_seed(0))
    assert [single.next().tolist() for _ in range(3)] == [[0]] * 3  # the only pair, again and again


def test_client_fields_and_generator_check():
    context = _client_context(num_classes=3)
    assert [(f.name, f.dtype, f.trailing_shape, f.max_rows) for f in FedKTLClient.upload_fields(context)] == [
        ("class_ids", torch.int64, (), 3), ("protos", torch.float32, (3,), 3)]  # K = C wide, at most C rows
    FedKTLClient.check_models(_client_context(latent_dim=1))  # H = 1 is a generator
    with pytest.raises(ConfigError, match=r"^FedKTL needs a generator \(generator\.name\)$"):
        FedKTLClient.check_models(_client_context(latent_dim=0))


@pytest.mark.parametrize("mu", [0.5, 1.0])
def test_client_loss_with_one_pair_and_a_small_mu(mu):
    """One downloaded pair is enough to transfer, and μ <= 1 still counts (lr = 0: the loss is
    ArcFace on the split plus μ·MSE(h′(f(I_0)), Q_0))."""
    context = _client_context(mu=mu)
    algorithm = FedKTLClient(context)
    client = _tiny_client()
    full = _pairs_download()
    pair = {"class_ids": full["class_ids"][:1], "images": full["images"][:1], "latents": full["latents"][:1]}
    with torch.no_grad():
        arcface = float(arcface_loss(client.model(client.train_x), client.train_y, algorithm.etf, 64.0, 0.5))
        transfer = float(F.mse_loss(algorithm.aux_init(client.model.features(pair["images"])), pair["latents"]))
    assert transfer > 0.01
    result = algorithm.train(client, pair, 1, torch_generator(0, "b"))
    assert result.loss_sum / result.samples == pytest.approx(arcface + mu * transfer, rel=1e-5)


def test_mu_zero_does_not_even_run_the_pairs_through_the_model():
    """μ = 0: the generated images never pass through f_i, so f_i's BatchNorm statistics (and so the
    eval-mode prototypes) are those of a round without pairs."""
    context = _client_context(lr=0.05, mu=0.0)
    with_pairs = FedKTLClient(context).train(_batchnorm_client(), _pairs_download(), 1, torch_generator(0, "b"))
    without = FedKTLClient(context).train(_batchnorm_client(), _empty_download(context), 1, torch_generator(0, "b"))
    assert torch.equal(with_pairs.upload["protos"], without.upload["protos"])


def test_htfllib_pair_batches_come_from_the_round_generator_not_the_global_rng():
    """pairs_per_step = 2 of C = 3 pairs: which two a step uses is drawn from the round's generator;
    reseeding torch's global RNG in between changes nothing."""
    context = _client_context(lr=0.05, compat="reference", pairs_per_step=2)

    def run(global_seed):
        client = _tiny_client(lr=0.05)
        torch.manual_seed(global_seed)
        return FedKTLClient(context).train(client, _pairs_download(), 1, torch_generator(0, "b")).upload["protos"]

    torch.testing.assert_close(run(1), run(2), rtol=0, atol=0)


def test_client_steps_h_prime_with_sgd_and_clips_both_to_norm_100(monkeypatch):
    """The local loop gets two optimizers, the client's and a plain SGD on h′ = Linear(K′ = 8, H = 5)
    at train.lr, and a before_step that clips f_i ∘ h_i's and h′'s gradients to norm 100 each."""
    calls = []
    real = fedktl_module.run_local_training

    def spy(client, context, loss_fn, generator, **kwargs):
        calls.append(kwargs)
        return real(client, context, loss_fn, generator, **kwargs)

    monkeypatch.setattr(fedktl_module, "run_local_training", spy)
    client = _tiny_client(lr=0.05)
    FedKTLClient(_client_context(lr=0.05)).train(client, _pairs_download(), 1, torch_generator(0, "b"))
    (kwargs,) = calls
    model_optimizer, aux_optimizer = kwargs["optimizers"]
    assert model_optimizer is client.optimizer
    assert type(aux_optimizer) is torch.optim.SGD and aux_optimizer.param_groups[0]["lr"] == 0.05
    aux_parameters = aux_optimizer.param_groups[0]["params"]
    assert [tuple(p.shape) for p in aux_parameters] == [(5, 8), (5,)]
    groups = (list(client.model.parameters()), aux_parameters)
    for group in groups:
        for parameter in group:
            parameter.grad = torch.full_like(parameter, 1000.0)  # norms far above 100
    kwargs["before_step"]()
    for group in groups:
        assert float(torch.stack([p.grad.norm() for p in group]).norm()) == pytest.approx(100.0, rel=1e-5)


@pytest.mark.parametrize("options", [{}, {"unit_prototypes": False}, {"compat": "reference", "unit_prototypes": False}])
def test_plain_mean_prototypes_when_unit_prototypes_is_off(options):
    """unit_prototypes = false (the paper's default): P_i^c is the plain mean of g_i(x) (lr = 0:
    the model never moves)."""
    client = _tiny_client()
    result = FedKTLClient(_client_context(**options)).train(client, _pairs_download(), 1, torch_generator(0, "b"))
    with torch.no_grad():
        client.model.eval()
        outputs = client.model(client.train_x)
    expected = torch.stack([outputs[client.train_y == c].mean(0) for c in (0, 2)])
    torch.testing.assert_close(result.upload["protos"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected.norm(dim=1), torch.ones(2), atol=1e-3)  # so not normalised


def test_head_prediction_is_the_same_nearest_column_rule():
    algorithm = FedKTLClient(_client_context(num_classes=2, feature_dim=4, latent_dim=3))
    algorithm.etf = torch.tensor([[0.6, -0.6], [0.8, -0.8]])  # ±v, v = (0.6, 0.8)
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.1], [-30.0, 20.0]])  # v·z = 0.6, 0.8, −0.52, −2
    assert algorithm.head_predict(_tiny_client(), logits).tolist() == [0, 0, 1, 1]


def test_squared_distances_by_hand():
    # a = (1,0), (0,2); b = (1,1), (3,0): ‖·‖² = [[0 + 1, 4 + 0], [1 + 1, 9 + 4]] = [[1, 4], [2, 13]]
    a, b = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[1.0, 1.0], [3.0, 0.0]])
    assert squared_distances(a, b).tolist() == [[1.0, 4.0], [2.0, 13.0]]
    assert squared_distances(b, b).tolist() == [[0.0, 5.0], [5.0, 0.0]]  # ‖(1,1) − (3,0)‖² = 4 + 1


def test_kernel_bandwidths_median_below_one_and_zero():
    # ‖q − w‖² = 0.01, 0.04, 0.09 → median 0.04 → 20 becomes 0.02: every σ² × 0.001
    queries = torch.tensor([[0.0, 0.0]])
    latents = torch.tensor([[0.1, 0.0], [0.0, 0.2], [0.3, 0.0]])
    assert kernel_bandwidths(queries, latents, "median") == pytest.approx((0.01, 0.015, 0.02, 0.05), rel=1e-5)
    # every latent on the query: median 0 is floored at 1e-12 → scale 1e-12/40 = 2.5e-14
    same = torch.zeros(3, 2)
    assert kernel_bandwidths(queries, same, "median") == pytest.approx((2.5e-13, 3.75e-13, 5e-13, 1.25e-12), rel=1e-9)


def test_kernel_saturation_uses_two_sigma_squared_and_strict_bounds():
    q = torch.tensor([[0.0]])
    # σ² = 1, d² = 15: k = e^{−15/2} = 5.5e-4 < 1e-3, saturated (e^{−15/3} = 6.7e-3 would not be)
    assert kernel_saturation(q, torch.tensor([[math.sqrt(15.0)]]), (1.0,)) == 1.0
    # σ² = 0.5 (k = e^{−d²}) and d² = −ln 0.999 ≈ 1.0005e-3: k is exactly float32(0.999) = 1 − 1e-3,
    # on the bound, which is not "above 1 − 1e-3"
    w = torch.tensor([[math.sqrt(-math.log(0.999))]])
    assert torch.exp(-(w * w)).item() == torch.tensor(0.999).item()  # the construction hits the bound
    assert kernel_saturation(q, w, (0.5,)) == 0.0


def test_feature_transformer_layers():
    """F = Linear(K, K) → BatchNorm1d(K) → ReLU → Linear(K, H), K = C = 4, H = 16."""
    layers = _server().transformer.layers
    assert [type(m) for m in layers] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert (layers[0].in_features, layers[0].out_features, layers[1].num_features) == (C, C, C)
    assert (layers[3].in_features, layers[3].out_features) == (C, H)


def test_server_fields_generator_width_and_upload_checks():
    context = _server_context()
    assert [(f.name, f.dtype, f.trailing_shape, f.max_rows) for f in FedKTLServer.download_fields(context)] == [
        ("class_ids", torch.int64, (), None), ("images", torch.float32, (1, 8, 8), None),
        ("latents", torch.float32, (H,), None)]
    narrow = AlgorithmContext(num_classes=C, feature_dim=8, seed=0, train=TrainConfig(),
                              options=parse_options(ENTRY, {}), latent_dim=8)
    with pytest.raises(ConfigError, match=r"^generator latents are 16 wide, the context says 8$"):
        FedKTLServer(narrow, generator=_tiny_generator())
    server = _server()
    with pytest.raises(ProtocolError, match=r"^client 4 sent 1 class ids for 2 rows$"):
        server.validate_upload(4, {"class_ids": torch.tensor([0]), "protos": torch.ones(2, C)})
    with pytest.raises(ProtocolError, match=r"^client 4 sent a class id outside \[0, 4\)$"):
        server.validate_upload(4, {"class_ids": torch.tensor([4]), "protos": torch.ones(1, C)})
    server.validate_upload(4, {"class_ids": torch.tensor([3, 0]), "protos": torch.ones(2, C)})


def test_uploads_without_rows_change_nothing():
    server = _server()
    empty = {0: {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, C)}}
    assert server.update(empty, 0, torch_generator(0, "server", 0)) == {}
    assert server.download()["latents"].shape == (0, H)  # still no pairs


@pytest.mark.parametrize("rows,trained", [(1, False), (2, True)])
def test_server_trains_from_two_prototypes(rows, trained):
    """F trains on >= 2 prototypes (BatchNorm needs two); with one, server_loss is None."""
    server = _server(server_epochs=2)
    upload = {"class_ids": torch.arange(rows), "protos": F.normalize(torch.ones(rows, C) + torch.eye(rows, C), dim=1)}
    result = server.update({0: upload}, 0, torch_generator(0, "server", 0))
    assert (result["server_loss"] is not None) == trained
    if trained:
        assert math.isfinite(result["server_loss"])


def test_a_trailing_single_prototype_batch_is_skipped():
    """3 prototypes in batches of 2: the second batch (one row) cannot train F's BatchNorm; skipped."""
    server = _server(server_epochs=2, server_batch_size=2)
    result = server.update({0: {"class_ids": torch.tensor([0, 1, 2]), "protos": torch.eye(3, C)}}, 0,
                           torch_generator(0, "server", 0))
    assert math.isfinite(result["server_loss"])


@pytest.mark.parametrize("compat", ["paper", "reference"])
def test_server_mse_at_the_first_step(compat):
    """One epoch, one batch of all 12 prototypes, no MMD, λ = 2: server_loss is the loss of that one
    step, at F's initial state in train mode. htfllib (table): 2·mean over pairs of ‖F(P) − T[y]‖²/H
    with T the eval-mode class means of F(P); paper (in_graph): 2·in_graph_mse of the train-mode F(P)."""
    server = _server(compat=compat, use_mmd=False, server_epochs=1, mse_weight=2.0)
    protos, labels = _pairs(_uploads())
    transformer = copy.deepcopy(server.transformer)
    with torch.no_grad():
        transformer.eval()
        evaluated = transformer(protos)
        table = torch.stack([evaluated[labels == c].mean(0) for c in range(C)])
        transformer.train()
        queries = transformer(protos)
    if compat == "reference":
        expected = 2.0 * float((queries - table[labels]).pow(2).mean())
    else:
        expected = 2.0 * float(in_graph_mse(queries, labels, C))
    result = server.update(_uploads(), 0, torch_generator(0, "server", 0))
    assert result["server_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("compat", ["paper", "reference"])
def test_adam_trains_f_and_only_in_table_mode_the_centroid_table(monkeypatch, compat):
    """htfllib: Adam (lr η_S) also trains a [C, H] table that starts at the eval-mode means of the
    present classes and at the kept centroids of the others; paper: F only."""
    created = []

    class Spy(torch.optim.Adam):
        def __init__(self, params, lr):
            params = list(params)
            created.append(([p.detach().clone() for p in params], lr))
            super().__init__(params, lr=lr)

    monkeypatch.setattr(torch.optim, "Adam", Spy)
    server = _server(compat=compat, server_lr=0.02, server_epochs=1)
    kept = server.centroids.clone()
    transformer = copy.deepcopy(server.transformer).eval()
    uploads = _uploads(classes=((0, 1), (1, 2), (0, 2)))  # class 3 absent
    protos, labels = _pairs(uploads)
    server.update(uploads, 0, torch_generator(0, "server", 0))
    ((parameters, lr),) = created
    assert lr == 0.02
    shapes = [tuple(p.shape) for p in server.transformer.parameters()]
    if compat == "paper":
        assert [tuple(p.shape) for p in parameters] == shapes
        return
    assert [tuple(p.shape) for p in parameters] == [*shapes, (C, H)]
    with torch.no_grad():
        evaluated = transformer(protos)
    for c in range(3):
        torch.testing.assert_close(parameters[-1][c], evaluated[labels == c].mean(0), rtol=1e-5, atol=1e-6)
    assert torch.equal(parameters[-1][3], kept[3])


def test_server_clips_f_and_the_table_to_norm_100_each(monkeypatch):
    calls = []
    real = fedktl_server_module.train_on_pairs

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(fedktl_server_module, "train_on_pairs", spy)
    server = _server(compat="reference", server_epochs=1)
    server.update(_uploads(), 0, torch_generator(0, "server", 0))
    ((args, kwargs),) = calls
    assert kwargs["skip_single"] is True
    optimizer = args[3]
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    transformer, table = parameters[:-1], parameters[-1:]
    for parameter in parameters:
        parameter.grad = torch.full_like(parameter, 1000.0)
    kwargs["before_step"]()
    for group in (transformer, table):
        assert float(torch.stack([p.grad.norm() for p in group]).norm()) == pytest.approx(100.0, rel=1e-5)


@pytest.mark.parametrize("mode", ["fixed", "median"])
def test_each_server_batch_is_matched_with_as_many_latents_at_the_right_bandwidths(monkeypatch, mode):
    """12 prototypes in batches of 5: the MMD compares 5, 5 and 2 queries with as many fresh latents
    (then all 12 in the diagnostics); fixed: σ² = (10, 15, 20, 50); median: those × median(d²)/40."""
    calls = []
    real = fedktl_server_module.mmd_loss

    def spy(queries, latents, bandwidths):
        calls.append((queries.detach().clone(), latents.clone(), bandwidths))
        return real(queries, latents, bandwidths)

    monkeypatch.setattr(fedktl_server_module, "mmd_loss", spy)
    server = _server(server_epochs=1, server_batch_size=5, mmd_bandwidth=mode)
    server.update(_uploads(), 0, torch_generator(0, "server", 0))
    assert [(q.shape[0], w.shape[0]) for q, w, _ in calls] == [(5, 5), (5, 5), (2, 2), (12, 12)]
    for queries, latents, bandwidths in calls:
        if mode == "fixed":
            assert bandwidths == (10.0, 15.0, 20.0, 50.0)
        else:
            median = float((queries[:, None] - latents[None]).pow(2).sum(-1).median())
            assert bandwidths == pytest.approx(tuple(s * median / 40 for s in (10.0, 15.0, 20.0, 50.0)), rel=1e-4)


def test_server_state_round_trips_into_a_differently_initialised_server():
    """F (with its BatchNorm statistics), the centroids and the pairs come back; the next round is
    then the same as on the original server."""
    server = _server(compat="reference", server_epochs=3)
    server.update(_uploads(classes=((0, 1), (1, 2))), 0, torch_generator(0, "server", 0))
    torch.manual_seed(1)  # another initial F and other N(0, 1) centroids
    fresh = FedKTLServer(_server_context(compat="reference", server_epochs=3), generator=_tiny_generator())
    assert not torch.equal(fresh.centroids, server.centroids)
    fresh.load_state_dict(copy.deepcopy(server.state_dict()))
    for key in ("class_ids", "images", "latents"):
        assert torch.equal(fresh.download()[key], server.download()[key])
    assert torch.equal(fresh.centroids, server.centroids)
    a = server.update(_uploads(classes=((1, 3),), seed=2), 1, torch_generator(0, "server", 1))
    b = fresh.update(_uploads(classes=((1, 3),), seed=2), 1, torch_generator(0, "server", 1))
    assert a == b
    assert torch.equal(fresh.download()["latents"], server.download()["latents"])
