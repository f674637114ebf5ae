"""FedKD: the SVD codec and both rank rules on matrices whose singular values are known, the wire
checks, the energy schedule, the server mean by hand, the persistent mentee and W_h, installing
downloads, real runs and checkpoint/resume equivalence."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import launch_smoke, make_client, make_context, roundtrip

from conftest import SMOKE, read_metrics, run_program
from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.algorithms import parameters as params
from htfl_dist.algorithms.compression import (
    RAW,
    check_compressed,
    compress_tensors,
    compressed_cost,
    float_count,
    payload_cost,
    recover_tensors,
    select_rank,
    svd_compress,
    svd_recover,
)
from htfl_dist.algorithms.fedkd import energy_at
from htfl_dist.algorithms.shared_model import build_shared_model, parameter_shapes
from htfl_dist.errors import ConfigError, HtflError, ProtocolError
from htfl_dist.seeding import seed_global_torch, torch_generator

# --------------------------------------------------------------------------- rank rules


@pytest.mark.parametrize("energies,energy,fixed,htfllib", [
    ([9.0, 4.0, 1.0], 0.9, 2, 2),  # 9/14 < 0.9 ≤ 13/14
    ([9.0, 4.0, 1.0], 0.95, 3, 0),  # 13/14 < 0.95: fixed keeps all three, htfllib finds no n ≤ 2 → 0
    ([3.0, 1.0], 0.75, 1, 0),  # exactly T·Σ after one value: fixed takes it (≥), htfllib needs > and n ≤ 1
    ([3.0, 1.0, 0.0], 0.75, 1, 2),
    ([5.0], 0.5, 1, 0),  # one singular value ([m, 1] matrices): htfllib always zeroes
])
def test_rank_rules_by_hand(energies, energy, fixed, htfllib):
    assert select_rank(torch.tensor(energies), energy, "fixed") == fixed
    assert select_rank(torch.tensor(energies), energy, "htfllib") == htfllib


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("rule", ["fixed", "htfllib"])
def test_rank_one_matrix_compresses_to_rank_one_and_recovers(rule):
    matrix = torch.outer(torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([2.0, 1.0, 0.0, -1.0, 4.0]))
    u, s, v, rank = svd_compress(matrix, 0.95, rule)
    assert rank == 1 and (u.shape, s.shape, v.shape) == ((4, 1), (1,), (1, 5))
    assert compressed_cost((4, 5), rank, rule) == 1 * (4 + 5 + 1)
    assert torch.allclose(svd_recover(u, s, v, rank, (4, 5), rule), matrix, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 20), (20, 8)])
def test_wide_and_tall_matrices_keep_their_largest_singular_pairs(shape):
    """A = 5·e₁f₁ᵀ + 2·e₂f₂ᵀ + 1·e₃f₃ᵀ (σ² = 25, 4, 1; T = 0.9 keeps two: 25/30 < 0.9 ≤ 29/30), wide
    and tall (a wide matrix is decomposed through its transpose): the factors are orthonormal,
    s = (5, 2), and the recovery is the rank-2 part, in both orientations."""
    stream = torch.Generator().manual_seed(3)
    left = torch.linalg.qr(torch.randn(shape[0], 3, generator=stream, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(shape[1], 3, generator=stream, dtype=torch.float64))[0]
    sigma = torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64)
    matrix = ((left * sigma) @ right.T).float()
    u, s, v, rank = svd_compress(matrix, 0.9, "fixed")
    assert rank == 2 and (u.shape, s.shape, v.shape) == ((shape[0], 2), (2,), (2, shape[1]))
    assert torch.allclose(s, torch.tensor([5.0, 2.0]), atol=1e-5)
    assert torch.allclose(u.T @ u, torch.eye(2), atol=1e-5) and torch.allclose(v @ v.T, torch.eye(2), atol=1e-5)
    kept = ((left[:, :2] * sigma[:2]) @ right[:, :2].T).float()
    assert torch.allclose(svd_recover(u, s, v, rank, shape, "fixed"), kept, atol=1e-5)


def test_energy_rule_on_a_diagonal_matrix():
    small = torch.diag(torch.tensor([3.0, 2.0, 1.0]))  # σ² = 9, 4, 1
    u, s, v, rank = svd_compress(small, 0.9, "htfllib")
    assert rank == 2
    assert torch.allclose(svd_recover(u, s, v, rank, (3, 3), "htfllib"), torch.diag(torch.tensor([3.0, 2.0, 0.0])),
                          atol=1e-6)
    u, s, v, rank = svd_compress(small, 0.95, "htfllib")  # the reference's rank-0 zeroing
    assert rank == 0 and u.shape == (3, 0) and torch.equal(svd_recover(u, s, v, rank, (3, 3), "htfllib"),
                                                           torch.zeros(3, 3))
    for energy in (0.9, 0.95):  # fixed: rank 2 or 3 would cost 14 or 21 ≥ 9 floats → raw
        u, s, v, rank = svd_compress(small, energy, "fixed")
        assert rank == RAW and torch.equal(svd_recover(u, s, v, rank, (3, 3), "fixed"), small)
    big = torch.zeros(10, 10)
    big[0, 0], big[1, 1], big[2, 2] = 3.0, 2.0, 1.0
    expected = {("fixed", 0.9): 2, ("fixed", 0.95): 3, ("htfllib", 0.9): 2, ("htfllib", 0.95): 3}
    for (rule, energy), wanted in expected.items():
        u, s, v, rank = svd_compress(big, energy, rule)
        assert rank == wanted, (rule, energy)
        assert compressed_cost((10, 10), rank, rule) == wanted * 21
        kept = big.clone()
        kept[wanted:, wanted:] = 0
        assert torch.allclose(svd_recover(u, s, v, rank, (10, 10), rule), kept, atol=1e-6)


def test_conv_weight_per_slice_versus_reshaped():
    """[o=2, i=1, 3, 3] with two different rank-1 slices: htfllib decomposes each 3×3 slice at the
    pooled rank 1 (2·1·1·(3+3+1) = 14 floats); fixed sees a rank-2 [2, 9] matrix, whose factors
    (2·(2+9+1) = 24) cost more than the 18 raw floats, so it sends it raw."""
    weight = torch.stack([torch.outer(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, -1.0])),
                          torch.outer(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([2.0, 5.0, 1.0]))]).unsqueeze(1)
    u, s, v, rank = svd_compress(weight, 0.95, "htfllib")
    assert rank == 1 and (u.shape, s.shape, v.shape) == ((2, 1, 3, 1), (2, 1, 1), (2, 1, 1, 3))
    assert compressed_cost(tuple(weight.shape), rank, "htfllib") == 14
    assert torch.allclose(svd_recover(u, s, v, rank, tuple(weight.shape), "htfllib"), weight, atol=1e-5)
    u, s, v, rank = svd_compress(weight, 0.95, "fixed")
    assert rank == RAW and compressed_cost(tuple(weight.shape), rank, "fixed") == 18
    assert torch.equal(svd_recover(u, s, v, rank, tuple(weight.shape), "fixed"), weight)
    # every slice diag(3, 2, 1): pooled energies 4·(9, 4, 1) → htfllib rank 2 at T = 0.9 in every
    # slice; fixed: the [2, 18] matrix has two equal rows → rank 1 (21 < 36 floats), exact
    diagonal = torch.diag(torch.tensor([3.0, 2.0, 1.0])).expand(2, 2, 3, 3).contiguous()
    u, s, v, rank = svd_compress(diagonal, 0.9, "htfllib")
    assert rank == 2 and u.shape == (2, 2, 3, 2)
    assert torch.allclose(svd_recover(u, s, v, rank, (2, 2, 3, 3), "htfllib"),
                          torch.diag(torch.tensor([3.0, 2.0, 0.0])).expand(2, 2, 3, 3), atol=1e-5)
    u, s, v, rank = svd_compress(diagonal, 0.9, "fixed")
    assert rank == 1 and compressed_cost((2, 2, 3, 3), rank, "fixed") == 21
    assert torch.allclose(svd_recover(u, s, v, rank, (2, 2, 3, 3), "fixed"), diagonal, atol=1e-5)


def test_fixed_rule_sends_raw_when_factors_cost_as_much():
    """A rank-1 [2, 3] matrix: 1·(2+3+1) = 6 = 2·3 floats, so fixed sends it raw; htfllib factors it."""
    matrix = torch.outer(torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0, 3.0]))
    assert svd_compress(matrix, 0.95, "fixed")[3] == RAW
    u, s, v, rank = svd_compress(matrix, 0.95, "htfllib")
    assert rank == 1 and compressed_cost((2, 3), rank, "htfllib") == 6
    assert torch.allclose(svd_recover(u, s, v, rank, (2, 3), "htfllib"), matrix, atol=1e-6)


@pytest.mark.parametrize("rule", ["fixed", "htfllib"])
def test_raw_fallbacks(rule):
    for tensor in (torch.arange(5.0), torch.arange(5.0).reshape(1, 5), torch.zeros(4, 6)):
        u, s, v, rank = svd_compress(tensor, 0.95, rule)
        assert rank == RAW and s.numel() == v.numel() == 0
        assert torch.equal(svd_recover(u, s, v, rank, tuple(tensor.shape), rule), tensor)
        assert compressed_cost(tuple(tensor.shape), rank, rule) == tensor.numel()


# --------------------------------------------------------------------------- wire


SHAPES = [(4, 5), (5,), (2, 1, 3, 3)]


def _tensors():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.mark.parametrize("rule", ["fixed", "htfllib"])
def test_payload_cost_is_what_travels(rule):
    payload, cost = compress_tensors(_tensors(), 0.9, rule)
    assert check_compressed(payload, SHAPES, rule) is None
    ranks = payload["ranks"].tolist()
    assert cost == payload_cost(payload, SHAPES, rule) == float_count(payload, 3)
    assert cost == sum(compressed_cost(shape, rank, rule) for shape, rank in zip(SHAPES, ranks, strict=True))
    assert ranks[1] == RAW
    for recovered, shape in zip(recover_tensors(payload, SHAPES, rule), SHAPES, strict=True):
        assert recovered.shape == shape


def _kd_server(rule="fixed", **options):
    entry, context = make_context("fedkd", num_classes=3, feature_dim=16, svd_rank=rule, **options)
    return entry, context, entry.server(context)


@pytest.mark.parametrize("damage,needle", [
    (lambda p: p.update(ranks=p["ranks"][:-1]), "ranks for"),
    (lambda p: p.update({"p0.u": p["p0.u"][:-1]}), "values in p0.u"),
    (lambda p: p.update({"p1.s": torch.zeros(2)}), "values in p1.s"),
    (lambda p: p.update(ranks=torch.full_like(p["ranks"], 0)), "rank 0"),  # fixed never chooses 0
    (lambda p: p.update(ranks=torch.full_like(p["ranks"], 999)), "rank 999"),
])
def test_server_refuses_malformed_compressed_uploads(damage, needle):
    _, context, server = _kd_server()
    shapes = parameter_shapes(context)
    payload, _ = compress_tensors([torch.randn(shape) for shape in shapes], 0.95, "fixed")
    server.validate_upload(4, payload)
    damage(payload)
    with pytest.raises(ProtocolError, match=needle) as info:
        server.validate_upload(4, payload)
    assert "client 4" in str(info.value)


def test_htfllib_rule_refuses_a_full_rank():
    """The reference's loop stops at len(σ) − 1: a declared rank len(σ) cannot come from it."""
    payload, _ = compress_tensors([torch.outer(torch.ones(4), torch.ones(5))], 0.95, "htfllib")
    assert check_compressed(payload, [(4, 5)], "htfllib") is None
    payload["ranks"] = torch.tensor([4])
    payload["p0.u"], payload["p0.s"], payload["p0.v"] = torch.zeros(16), torch.zeros(4), torch.zeros(20)
    assert "rank 4" in check_compressed(payload, [(4, 5)], "htfllib")
    assert check_compressed(payload, [(4, 5)], "fixed") is None


# --------------------------------------------------------------------------- options and schedule


def test_options_defaults_and_compat():
    options = parse_options(get_algorithm("fedkd"), {})
    assert (options.svd_rank, options.compress, options.t_start, options.t_end, options.global_rounds,
            options.mentee_lr, options.wh_lr) == ("fixed", "update", 0.95, 0.98, 2000, 0.01, None)
    reference = parse_options(get_algorithm("fedkd"), {"compat": "reference"})
    assert (reference.svd_rank, reference.compress) == ("htfllib", "weights")
    mixed = parse_options(get_algorithm("fedkd"), {"compat": "reference", "compress": "update"})
    assert (mixed.svd_rank, mixed.compress) == ("htfllib", "update")


@pytest.mark.parametrize("options,key", [
    ({"t_start": 0.0}, "algo.t_start"), ({"t_end": 1.5}, "algo.t_end"), ({"global_rounds": 0}, "algo.global_rounds"),
    ({"mentee_lr": -1}, "algo.mentee_lr"), ({"wh_lr": 0}, "algo.wh_lr"), ({"svd_rank": "auto"}, "algo.svd_rank"),
    ({"compress": "grads"}, "algo.compress"),
])
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        parse_options(get_algorithm("fedkd"), options)
    assert "\n" not in str(info.value)


def test_energy_schedule():
    options = parse_options(get_algorithm("fedkd"), {"global_rounds": 100})
    assert energy_at(options, 0) == pytest.approx(0.95)
    assert energy_at(options, 50) == pytest.approx(0.965)
    assert energy_at(options, 100) == pytest.approx(0.98)
    assert energy_at(options, 300) == pytest.approx(0.98)  # capped at R
    assert energy_at(parse_options(get_algorithm("fedkd"), {}), 300) == pytest.approx(0.95 + 0.15 * 0.03)


# --------------------------------------------------------------------------- server


def test_uniform_mean_by_hand_then_recompressed():
    _, context, server = _kd_server()
    shapes = parameter_shapes(context)
    assert server.download()["version"].tolist() == [0] and server.theory_download_floats() == 0
    uploads = {c: compress_tensors([torch.full(shape, value) for shape in shapes], 0.95, "fixed")[0]
               for c, value in ((0, 1.0), (2, 3.0), (5, 5.0))}
    diagnostics = server.update(uploads, 0, torch_generator(0, "server", 0))
    download = server.download()
    assert download["version"].tolist() == [1]
    for tensor in recover_tensors(download, shapes, "fixed"):  # constants are rank 1: exact
        assert torch.allclose(tensor, torch.full_like(tensor, 3.0), atol=1e-5)  # (1 + 3 + 5) / 3
    assert server.theory_download_floats() == diagnostics["floats_down"] == diagnostics["floats_down_theory"]
    assert diagnostics["floats_up"] == diagnostics["floats_up_theory"] == 3 * payload_cost(uploads[0], shapes, "fixed")
    assert diagnostics["energy"] == pytest.approx(0.95)
    # screened-out round: unchanged; state survives weights_only
    before = {k: v.clone() for k, v in server.download().items()}
    fresh = get_algorithm("fedkd").server(context)
    fresh.load_state_dict(roundtrip(server.state_dict()))
    for name, tensor in before.items():
        assert torch.equal(fresh.download()[name], tensor) and torch.equal(server.download()[name], tensor)


# --------------------------------------------------------------------------- client


def _kd_clients(count=2, **options):
    entry, context = make_context("fedkd", num_classes=3, feature_dim=16, batch_size=4, **options)
    algorithm = entry.client(context)
    clients = []
    for client_id in range(count):
        client = make_client(context, client_id=client_id, samples=9, data_seed=client_id)
        seed_global_torch(0, "algorithm-init", client_id)
        algorithm.init_client(client)
        clients.append(client)
    return entry, context, algorithm, clients


def _train(algorithm, client, knowledge, round_index=0):
    seed_global_torch(0, "train", client.client_id, round_index)
    return algorithm.train(client, knowledge, round_index, torch_generator(0, "batches", client.client_id, round_index))


def test_mentee_and_w_h_live_in_client_modules_and_persist():
    entry, context, algorithm, clients = _kd_clients()
    initial = params.parameter_row(build_shared_model(context))
    for client in clients:
        assert set(client.modules) == {"mentee", "w_h", "sync"}
        assert torch.equal(params.parameter_row(client.modules["mentee"]), initial)  # identical start
        w_h = client.modules["w_h"]
        assert isinstance(w_h, torch.nn.Linear) and w_h.weight.shape == (16, 16) and w_h.bias is None
        assert torch.equal(client.modules["sync"].row, initial.reshape(-1))
    assert not torch.equal(clients[0].modules["w_h"].weight, clients[1].modules["w_h"].weight)
    server = entry.server(context)
    client = clients[0]
    w_h_before = client.modules["w_h"].weight.detach().clone()
    result = _train(algorithm, client, server.download())
    mentee_after = params.parameter_row(client.modules["mentee"])
    assert not torch.equal(mentee_after, initial) and not torch.equal(client.modules["w_h"].weight, w_h_before)
    server.validate_upload(0, result.upload)
    shapes = parameter_shapes(context)
    assert algorithm.theory_upload_floats(client) == payload_cost(result.upload, shapes, "fixed")
    # the upload is the compressed update ΔG = G_i − G_0, within the energy bound per parameter
    delta = (mentee_after - initial).reshape(-1)
    recovered = torch.cat([t.reshape(-1) for t in recover_tensors(result.upload, shapes, "fixed")])
    offset = 0
    for shape in shapes:
        size = math.prod(shape)
        part, approx = delta[offset:offset + size], recovered[offset:offset + size]
        assert float((approx - part).norm()) <= math.sqrt(1 - 0.95) * float(part.norm()) + 1e-6
        offset += size
    # state of every module survives torch.load(weights_only=True)
    for module in client.modules.values():
        state = roundtrip(module.state_dict())
        assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())


def test_mentor_mentee_and_w_h_are_each_clipped_to_norm_10():
    """One batch (4 samples, batch 4) of inputs scaled ×1000: every gradient is huge, so one SGD step
    moves each module by exactly lr·10 (its clipped gradient norm)."""
    entry, context, algorithm, clients = _kd_clients(count=1, mentee_lr=0.02, wh_lr=0.03)
    client = clients[0]
    client.train_x, client.train_y = client.train_x[:4] * 1000, client.train_y[:4]
    modules = {"mentor": (client.model, 0.05), "mentee": (client.modules["mentee"], 0.02),
               "w_h": (client.modules["w_h"], 0.03)}
    before = {name: params.parameter_row(module) for name, (module, _) in modules.items()}
    _train(algorithm, client, entry.server(context).download())
    for name, (module, lr) in modules.items():
        moved = float((params.parameter_row(module) - before[name]).norm())
        assert moved == pytest.approx(lr * 10, rel=1e-3), name


def test_update_mode_install_keeps_every_mentee_identical_and_happens_once():
    entry, context, algorithm, clients = _kd_clients(count=3)
    server = entry.server(context)
    initial = params.parameter_row(build_shared_model(context)).reshape(-1)
    uploads = {c.client_id: _train(algorithm, c, server.download()).upload for c in clients[:2]}  # client 2 idles
    server.update(uploads, 0, torch_generator(0, "server", 0))
    knowledge = server.download()
    mean = torch.cat([t.reshape(-1) for t in recover_tensors(knowledge, parameter_shapes(context), "fixed")])
    algorithm.prepare_evaluation(clients[0], knowledge)
    algorithm.prepare_evaluation(clients[2], knowledge)
    _train(algorithm, clients[1], knowledge, round_index=1)  # installs at the start of training
    for client in clients:
        assert int(client.modules["sync"].version) == 1
        assert torch.allclose(client.modules["sync"].row, initial + mean, atol=1e-6)
        assert torch.equal(client.modules["sync"].row, clients[0].modules["sync"].row)
    assert torch.equal(params.parameter_row(clients[0].modules["mentee"]), clients[0].modules["sync"].row[None])
    installed = params.parameter_row(clients[2].modules["mentee"]).clone()
    algorithm.prepare_evaluation(clients[2], knowledge)  # the same update again: nothing changes
    assert torch.equal(params.parameter_row(clients[2].modules["mentee"]), installed)
    skipped = dict(knowledge, version=torch.tensor([3]))
    with pytest.raises(HtflError, match="every client must receive every update"):
        algorithm.prepare_evaluation(clients[2], skipped)


def test_weights_mode_uploads_the_mentee_and_overwrites_it_with_the_download():
    entry, context, algorithm, clients = _kd_clients(count=2, compress="weights", svd_rank="htfllib")
    server = entry.server(context)
    shapes = parameter_shapes(context)
    uploads = {}
    for client in clients:
        uploads[client.client_id] = _train(algorithm, client, server.download()).upload
        # weights, not an update: each parameter is the mentee's within the energy bound, or zeros at rank 0
        recovered = recover_tensors(uploads[client.client_id], shapes, "htfllib")
        ranks = uploads[client.client_id]["ranks"].tolist()
        for rank, approx, weight in zip(ranks, recovered, client.modules["mentee"].parameters(), strict=True):
            weight = weight.detach()
            if rank == 0:
                assert not bool(approx.any())
            else:
                assert float((approx - weight).norm()) <= math.sqrt(1 - 0.95) * float(weight.norm()) + 1e-6
        server.validate_upload(client.client_id, uploads[client.client_id])
    server.update(uploads, 0, torch_generator(0, "server", 0))
    knowledge = server.download()
    expected = torch.cat([t.reshape(-1) for t in recover_tensors(knowledge, shapes, "htfllib")])
    for client in clients:
        algorithm.prepare_evaluation(client, knowledge)
        assert torch.equal(params.parameter_row(client.modules["mentee"]).reshape(-1), expected)


# --------------------------------------------------------------------------- real runs


SMALL_MENTEE = ("algo.shared_model=htcnn2",)
"""The smallest HtCNN8 member as the mentee: the default (htcnn1, client 0's) spends most of each
round in float64 SVDs of its 512x4608 layer. The conformance test runs the same two rounds."""


@pytest.mark.integration
def test_real_run(single_run):
    """The paper's defaults, mentee included (htcnn1), once."""
    rows = launch_smoke(single_run, "fedkd")
    assert all(r["test_acc"] == r["test_acc_head"] for r in rows)  # the mentor is evaluated, by argmax
    for row in rows:
        assert row["floats_up"] == row["floats_up_theory"] == row["bytes_theory_up"] // 4
    assert rows[0]["bytes_theory_down"] == 0 and rows[1]["bytes_theory_down"] > 0  # nothing sent before round 1


@pytest.mark.integration
def test_real_run_htfllib(single_run):
    rows = launch_smoke(single_run, "fedkd", "algo.compat=reference", *SMALL_MENTEE)
    assert rows[0]["ranks_down"][0] > 0  # the conv weight travels as per-slice factors


@pytest.mark.integration
def test_resume_matches_the_uninterrupted_run(single_run, tmp_path, cache_dir):
    """Mentee, W_h and the sync record are checkpointed with the client; the server's download too."""
    uninterrupted = launch_smoke(single_run, "fedkd", *SMALL_MENTEE)
    args = ["--config", str(SMOKE), "--out", str(tmp_path), "algorithm=fedkd", f"data.cache_dir={cache_dir}",
            "checkpoint_every=1", *SMALL_MENTEE]
    first = run_program([*args, "rounds=1"])
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = run_program([*args, "rounds=2", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [1, 2]
    for key in ("test_acc", "train_loss", "bytes_theory_up", "bytes_theory_down", "floats_up", "ranks_down",
                "mean_norm"):
        assert rows[1][key] == uninterrupted[1][key], key


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_option_bounds_are_inclusive_where_documented():
    """T ∈ (0, 1] includes 1; R ≥ 1 includes 1; the messages are the exact one-liners."""
    entry = get_algorithm("fedkd")
    parse_options(entry, {"t_start": 1.0, "t_end": 1.0})
    assert energy_at(parse_options(entry, {"global_rounds": 1}), 5) == pytest.approx(0.98)  # R = 1: T_end from t = 1
    with pytest.raises(ConfigError) as info:
        parse_options(entry, {"global_rounds": 0})
    assert str(info.value) == "config key 'algo.global_rounds' must be >= 1, got 0"
    with pytest.raises(ConfigError) as info:
        parse_options(entry, {"t_end": 1.5})
    assert str(info.value) == "config key 'algo.t_end' must be in (0, 1], got 1.5"


def test_layout_max_rank_and_allowed_ranks_by_hand():
    """[4, 5]: a matrix with min(4, 5) = 4 singular values; [5] and [1, 5]: raw (none). A conv weight
    [2, 1, 3, 5] is the [2, 15] matrix under fixed (2 values) but 2·1 slices of 3×5 under htfllib
    (min(3, 5) = 3 values each); a 3-D tensor is always a matrix. fixed may declare 1 … k, htfllib
    0 … k − 1 (its loop never reaches k)."""
    from htfl_dist.algorithms.compression import allowed_ranks, layout, max_rank

    assert layout((4, 5), "fixed") == layout((4, 5), "htfllib") == layout((2, 3, 5), "htfllib") == "matrix"
    assert layout((5,), "fixed") == layout((1, 5), "htfllib") == "raw"
    assert (layout((2, 1, 3, 5), "fixed"), layout((2, 1, 3, 5), "htfllib")) == ("matrix", "slices")
    assert max_rank((4, 5), "fixed") == max_rank((4, 5), "htfllib") == 4
    assert max_rank((5,), "fixed") == max_rank((1, 5), "htfllib") == 0
    assert (max_rank((2, 1, 3, 5), "fixed"), max_rank((2, 1, 3, 5), "htfllib"), max_rank((2, 1, 5, 3), "htfllib")) \
        == (2, 3, 3)
    assert list(allowed_ranks((4, 5), "fixed")) == [1, 2, 3, 4]
    assert list(allowed_ranks((4, 5), "htfllib")) == [0, 1, 2, 3]
    assert list(allowed_ranks((2, 1, 3, 5), "fixed")) == [1, 2]
    assert list(allowed_ranks((2, 1, 3, 5), "htfllib")) == [0, 1, 2]
    assert tuple(allowed_ranks((5,), "fixed")) == tuple(allowed_ranks((1, 5), "htfllib")) == ()


def test_htfllib_rule_when_the_total_energy_is_below_one():
    """e = (0.5, 0.25, 0.125) (exact in binary), T = 0.5: threshold 0.4375. fixed stops at n = 1
    (0.5 ≥ 0.4375); htfllib starts from an empty sum 0 at n = 0 (not above) and stops at n = 1."""
    assert select_rank(torch.tensor([0.5, 0.25, 0.125]), 0.5, "fixed") == 1
    assert select_rank(torch.tensor([0.5, 0.25, 0.125]), 0.5, "htfllib") == 1


def test_slice_cost_multiplies_out_and_in_channels():
    """[o=2, i=3, 4, 5] at rank 2: slices cost 2·3·2·(4+5+1) = 120 floats; as the [2, 60] matrix
    (fixed) 2·(2+60+1) = 126."""
    assert compressed_cost((2, 3, 4, 5), 2, "htfllib") == 120
    assert compressed_cost((2, 3, 4, 5), 2, "fixed") == 126


def test_compressed_fields_bound_every_factor_by_its_tensor():
    from htfl_dist.algorithms.compression import compressed_fields, empty_compressed
    from htfl_dist.payload import Field

    # one rank per tensor; each factor at most numel rows: 4·5 = 20 for the matrix, 5 for the bias
    assert compressed_fields([(4, 5), (5,)]) == (
        Field("ranks", torch.int64, max_rows=2),
        Field("p0.u", torch.float32, max_rows=20), Field("p0.s", torch.float32, max_rows=20),
        Field("p0.v", torch.float32, max_rows=20),
        Field("p1.u", torch.float32, max_rows=5), Field("p1.s", torch.float32, max_rows=5),
        Field("p1.v", torch.float32, max_rows=5))
    empty = empty_compressed([(4, 5), (5,)])
    assert empty["ranks"].dtype == torch.int64 and empty["p1.v"].dtype == torch.float32
    assert all(tensor.numel() == 0 for tensor in empty.values())


def test_fedkd_fields_are_the_codec_fields_plus_the_version():
    from htfl_dist.algorithms.compression import compressed_fields
    from htfl_dist.payload import Field

    entry, context = make_context("fedkd", num_classes=3, feature_dim=16)
    codec = compressed_fields(parameter_shapes(context))
    assert entry.client.upload_fields(context) == codec
    assert entry.server.download_fields(context) == (Field("version", torch.int64, max_rows=1), *codec)


def test_payload_cost_and_recovery_refuse_a_rank_count_that_does_not_match():
    """Two ranks for three shapes: zip(strict=True) raises instead of silently dropping a tensor."""
    payload, _ = compress_tensors([torch.ones(5), torch.ones(3)], 0.95, "fixed")
    with pytest.raises(ValueError):
        payload_cost(payload, [(5,), (3,), (2,)], "fixed")
    with pytest.raises(ValueError):
        recover_tensors(payload, [(5,), (3,), (2,)], "fixed")


def test_server_counts_versions_and_reports_by_hand():
    """Uploads 1, 3, 5 everywhere (constants: rank 1 or raw, exact): the mean is 3 in each of the P
    shared parameters, so ‖mean‖ = 3·√P; each update increments the version."""
    _, context, server = _kd_server()
    shapes = parameter_shapes(context)
    count = params.parameter_count(build_shared_model(context))
    uploads = {c: compress_tensors([torch.full(shape, value) for shape in shapes], 0.95, "fixed")[0]
               for c, value in ((0, 1.0), (2, 3.0), (5, 5.0))}
    got = server.update(uploads, 0, torch_generator(0, "server", 0))
    assert got["shared_floats"] == count
    assert got["mean_norm"] == pytest.approx(3.0 * math.sqrt(count), rel=1e-5)
    assert got["ranks_down"] == server.download()["ranks"].tolist()
    assert server.download()["version"].dtype == torch.int64
    server.update(uploads, 1, torch_generator(0, "server", 1))
    assert server.download()["version"].tolist() == [2]
    assert roundtrip(server.state_dict())["version"].dtype == torch.int64


def test_server_mean_is_summed_in_float64():
    """Raw (1-D) parameters of 1, 1e-8 and −1 in client order: float64 keeps 1e-8, so the mean is
    1e-8/3; a float32 sum would lose it (1 + 1e-8 rounds to 1) and give 0."""
    _, context, server = _kd_server()
    shapes = parameter_shapes(context)
    uploads = {c: compress_tensors([torch.full(shape, value) for shape in shapes], 0.95, "fixed")[0]
               for c, value in ((0, 1.0), (1, 1e-8), (2, -1.0))}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    for shape, tensor in zip(shapes, recover_tensors(server.download(), shapes, "fixed"), strict=True):
        if len(shape) == 1:
            assert torch.allclose(tensor, torch.full(shape, 1e-8 / 3), rtol=1e-5, atol=0.0)


def test_htfllib_server_costs_count_conv_slices():
    """Under htfllib the conv weights travel as per-slice factors: the theoretical floats each way
    (o·i·r(kh+kw+1) per conv weight) equal the floats actually carried."""
    _, context, server = _kd_server("htfllib")
    shapes = parameter_shapes(context)
    assert any(len(shape) == 4 for shape in shapes)
    uploads = {c: compress_tensors([torch.randn(shape) for shape in shapes], 0.95, "htfllib")[0] for c in (0, 1)}
    got = server.update(uploads, 0, torch_generator(0, "server", 0))
    assert got["floats_up_theory"] == got["floats_up"]
    assert server.theory_download_floats() == got["floats_down"] == got["floats_down_theory"]


def test_client_records_sync_state_costs_and_samples():
    _, _, algorithm, clients = _kd_clients(count=2)
    assert clients[0].modules["sync"].version.dtype == torch.int64
    assert algorithm.theory_upload_floats(clients[0]) == 0  # nothing uploaded yet
    server = get_algorithm("fedkd").server(_kd_server()[1])
    result = _train(algorithm, clients[0], server.download())
    assert result.samples == 8  # 9 samples in batches of 4: 4 + 4, the final single sample is skipped
    assert isinstance(result.loss_sum, float) and result.loss_sum > 0
    assert algorithm.theory_upload_floats(clients[0]) > 0
    assert algorithm.theory_upload_floats(clients[1]) == 0  # client 1 has not uploaded
    _, _, _, weights = _kd_clients(count=1, compress="weights")
    assert weights[0].modules["sync"].row.numel() == 0  # weights mode keeps no G_sync


def test_batches_come_from_the_round_generator_not_the_global_stream():
    """The same client, generator and start, under two different global seeds: identical uploads."""
    uploads = []
    for global_seed in (1, 2):
        entry, context, algorithm, clients = _kd_clients(count=1)
        torch.manual_seed(global_seed)
        result = algorithm.train(clients[0], entry.server(context).download(), 0, torch_generator(0, "batches", 0))
        uploads.append(result.upload)
    assert all(torch.equal(uploads[0][name], uploads[1][name]) for name in uploads[0])


def test_w_h_learning_rate_defaults_to_the_client_lr():
    """As the clipping test, without wh_lr: W_h moves by train.lr·10 = 0.05·10."""
    entry, context, algorithm, clients = _kd_clients(count=1)
    client = clients[0]
    client.train_x, client.train_y = client.train_x[:4] * 1000, client.train_y[:4]
    before = params.parameter_row(client.modules["w_h"])
    _train(algorithm, client, entry.server(context).download())
    moved = float((params.parameter_row(client.modules["w_h"]) - before).norm())
    assert moved == pytest.approx(0.5, rel=1e-3)
