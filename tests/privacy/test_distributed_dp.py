"""Distributed DP under secure aggregation (``privacy.noise_split=distributed``;
htfl_dist/privacy/distributed.py): each client adds the share σ²B²/t of the noise variance, so every
sum the server can unmask (at least t contributions) carries σ²B². Checked by hand, statistically
from the secure source, in a run through the protocol (the sum's noise, the server's view of one
client, two runs of one seed), and the refusals."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import SMOKE
from htfl_dist.errors import ConfigError
from htfl_dist.privacy.accounting import PrivacyPlan
from htfl_dist.privacy.distributed import (
    check_clip_range,
    clipped_share_bound,
    fill_unreleased,
    guaranteed_contributors,
)
from htfl_dist.privacy.noise import SecureNoise
from htfl_dist.privacy.release import noisy_class_means
from htfl_dist.runtime.session import checked_config

DISTRIBUTED = ("privacy.enabled=true", "privacy.secure_aggregation=true", "privacy.noise_split=distributed")


def _plan(sigma: float = 2.0, clip: float = 1.0, min_count: int = 10, t: int = 4, split: str = "distributed"
          ) -> PrivacyPlan:
    return PrivacyPlan(noise_multiplier=sigma, target_epsilon=4.0, delta=1e-5, feature_clip=clip, max_grad_norm=1.0,
                       min_class_samples=min_count, accountant="rdp", local_epochs=1, seed=0,
                       noise_split=split, contributors=t)  # type: ignore[arg-type]


def test_the_split_by_hand():
    """σ = 2, S = 1, m = 10, t = 4: B = 2·1/10 = 0.2; each client's multiplier σ/√t = 1, its std
    1·0.2 = 0.2 (variance 0.04 = σ²B²/t = 4·0.04/4); four such clients: variance 0.16 = σ²B²."""
    multiplier, bound = _plan().release_noise()
    assert multiplier == pytest.approx(1.0) and bound == pytest.approx(0.2)
    assert _plan().filler_std() == pytest.approx(0.2)
    assert _plan(split="local").release_noise() == (2.0, None) and _plan(split="local").filler_std() == 0.0
    assert _plan().release_noise(noise_multiplier=6.0)[0] == pytest.approx(3.0)  # the ledger's kept σ
    # against the local mode at the smallest released count n_c = m = 10: σ·2S/m = 0.4, √t = 2 times more
    local_at_m = 2.0 * (2 * 1.0 / 10)
    assert local_at_m / (multiplier * bound) == pytest.approx(math.sqrt(4))


def test_the_guaranteed_contributors_by_hand():
    """t at the run's smallest round: int(N·ρ) participants, holders = n (every pair) or k + 1."""
    assert guaranteed_contributors(6, 1.0, None, 0.5) == 4  # ⌊0.5·6⌋ + 1
    assert guaranteed_contributors(20, 0.5, None, 0.5) == 6  # 10 participants
    assert guaranteed_contributors(100, 0.1, 4, 0.5) == 3  # 10 participants, 5 holders: ⌊2.5⌋ + 1
    assert guaranteed_contributors(100, 0.1, 4, 0.7) == 4  # 5 holders (not the 4 neighbours): ⌊3.5⌋ + 1
    assert guaranteed_contributors(100, 0.1, 10, 0.5) == 6  # k = 10 ≥ n − 1 = 9: every pair
    assert guaranteed_contributors(1000, 0.1, 10, 0.7) == 8  # 11 holders: ⌊7.7⌋ + 1


def test_the_plan_of_a_distributed_run():
    """The smoke config (6 clients, every one each round, secagg_threshold 0.5): t = 4, not the 6
    contributors of a full round, so each release's multiplier is σ/2 at B = 2·1/10; the local
    plan of the same run keeps σ and each row's own sensitivity."""
    from htfl_dist.privacy.startup import privacy_plan
    from htfl_dist.resolution import resolved_config

    plan = privacy_plan(resolved_config(str(SMOKE), list(DISTRIBUTED)))
    assert plan is not None and plan.contributors == 4 and plan.noise_split == "distributed"
    multiplier, bound = plan.release_noise()
    assert multiplier == pytest.approx(plan.noise_multiplier / 2) and bound == pytest.approx(0.2)
    local = privacy_plan(resolved_config(str(SMOKE), [*DISTRIBUTED, "privacy.noise_split=local"]))
    assert local is not None and local.contributors == 1 and local.release_noise() == (local.noise_multiplier, None)


def _release_noise(plan: PrivacyPlan, entries: int) -> torch.Tensor:
    """One client's release noise for one class of ``entries`` dimensions held by 50 samples,
    drawn from the secure source as the trainer draws it (the mean subtracted)."""
    sums, counts = torch.full((1, entries), 5.0), torch.tensor([50.0])
    multiplier, bound = plan.release_noise()
    _, rows = noisy_class_means(sums, counts, clip=plan.feature_clip, noise_multiplier=multiplier,
                                min_count=plan.min_class_samples, noise=SecureNoise(), sensitivity=bound)
    return rows.double()[0] - 0.1


def test_t_clients_noise_sums_to_the_central_variance():
    """Statistical: 200,000 entries a client (the sample variance's relative std √(2/N) = 0.32 %,
    tolerance 2 %, over 6 of them): one client's variance is σ²B²/t = 0.04 whatever its count
    (here 50, not m), and the sum of t = 4 clients' is σ²B² = 0.16."""
    plan, entries = _plan(), 200_000
    clients = [_release_noise(plan, entries) for _ in range(plan.contributors)]
    assert float(clients[0].var()) == pytest.approx(0.04, rel=0.02)
    assert float(clients[0].mean()) == pytest.approx(0.0, abs=0.002)  # 5 standard errors of the mean
    assert float(torch.stack(clients).sum(0).var()) == pytest.approx(0.16, rel=0.02)
    assert not torch.equal(clients[0], clients[1])


def test_the_unreleased_rows_are_filled_with_the_same_share():
    """A class the client does not release (weight 0) gets N(0, (σB/√t)²) in its row; released rows
    and the weights are left exactly as they are (the release noised those rows already)."""
    rows = torch.zeros(3, 100_000, dtype=torch.float64)
    rows[1] = 0.5
    weights = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    filled = fill_unreleased({"row_sums": rows, "weights": weights}, 0.2, SecureNoise())
    assert torch.equal(filled["weights"], weights) and torch.equal(filled["row_sums"][1], rows[1])
    for row in (0, 2):
        assert float(filled["row_sums"][row].var()) == pytest.approx(0.04, rel=0.03)
    assert not torch.equal(filled["row_sums"][0], filled["row_sums"][2])
    with pytest.raises(ValueError, match="class-row contributions"):
        fill_unreleased({"parts": rows}, 0.2, SecureNoise())


def test_the_clip_range_against_the_noise_by_hand():
    """Entries within ±1 plus noise of std 1: a clip at 3 cuts at most erfc(2/√2) = 4.55 % (refused
    in one line naming the key); the default clip 8 against the smoke run's std 0.164 cuts nothing
    measurable (erfc(7/(0.164·√2)) underflows to 0)."""
    assert clipped_share_bound(1.0, 1.0, 3.0) == pytest.approx(0.0455, abs=1e-4)
    assert clipped_share_bound(1.0, 1.0, 1.0) == 1.0
    assert clipped_share_bound(1.0, 0.164, 8.0) < 1e-12
    with pytest.raises(ConfigError, match=r"^privacy.secagg_clip=3 would clip up to 4.55% .* at least 6$"):
        check_clip_range(1.0, 1.0, 3.0)
    check_clip_range(1.0, 0.164, 8.0)


@pytest.mark.parametrize(("overrides", "message"), [
    (("privacy.enabled=true", "privacy.noise_split=distributed"),
     r"^privacy.noise_split=distributed needs privacy.secure_aggregation=true: without it the server sees each"),
    (("privacy.noise_split=distributed",), r"^privacy.noise_split=distributed needs privacy.secure_aggregation"),
    (("privacy.secure_aggregation=true", "privacy.noise_split=distributed"),
     r"^privacy.noise_split=distributed splits the noise of differential privacy, which is off; set privacy.enabled"),
    ((*DISTRIBUTED, "privacy.secagg_clip=1.2", "privacy.min_class_samples=1", "privacy.target_epsilon=1"),
     r"^privacy.secagg_clip=1.2 would clip up to"),
])
def test_what_the_distributed_split_cannot_run_with_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        checked_config(str(SMOKE), list(overrides), world_size=1)
    assert "\n" not in str(refused.value)


def test_the_split_is_added_later_and_local_keeps_the_hash():
    from htfl_dist.resolution import resolved_config

    secure = ("privacy.enabled=true", "privacy.secure_aggregation=true")
    before, local = resolved_config(None, list(secure)), resolved_config(None, [*secure, "privacy.noise_split=local"])
    distributed = resolved_config(None, list(DISTRIBUTED))
    assert before.config_hash() == local.config_hash() != distributed.config_hash()


def test_summary_says_which_guarantee_holds_against_whom():
    """The ε against the server is the ledger's (σ); against the server with every other
    contributor only the client's own σ/√t covers its release: 1 round, 1 epoch, σ = 2, t = 4,
    so DP-SGD at σ = 2 and the release at σ = 1, larger than two mechanisms at σ = 2."""
    from htfl_dist.privacy.accounting import epsilon_spent

    plan = PrivacyPlan(**{**_plan().__dict__, "planned_rounds": 1})
    described = plan.describe()
    assert described["noise_split"] == "distributed"
    guarantees = described["guarantees"]
    assert guarantees["contributors_at_least"] == 4 and guarantees["sum_noise_std_at_least"] == pytest.approx(0.4)
    assert guarantees["client_noise_std"] == pytest.approx(0.2)
    coalition = guarantees["epsilon_against_server_with_all_other_contributors_at_most"]
    assert coalition == pytest.approx(epsilon_spent(((2.0, 1.0, 1), (1.0, 1.0, 1)), 1e-5, "rdp"))
    assert coalition > epsilon_spent(((2.0, 1.0, 2),), 1e-5, "rdp")
    assert "against_everyone" in _plan(split="local").describe()["guarantees"]


def test_a_round_below_the_planned_threshold_unmasks_nothing():
    """The noise is split for t of the smallest round; a round whose own threshold is lower (fewer
    participants than planned) releases no sum, on every rank alike, before any protocol message."""
    from htfl_dist.resolution import resolved_config
    from htfl_dist.runtime.secure_exchange import SecureSums
    from htfl_dist.runtime.secure_exchange import guaranteed_contributors as planned

    config = resolved_config(str(SMOKE), list(DISTRIBUTED))
    assert planned(config) == 4 and planned(resolved_config(str(SMOKE), ["privacy.secure_aggregation=true"])) == 2

    sums = SecureSums(_Rank0(), _class_row_entry(), None, config.privacy, str, contributors=4)  # type: ignore[arg-type]
    result = sums.gather({}, [0, 1, 2, 3, 4], {i: 0 for i in range(5)}, 0, None)  # type: ignore[arg-type]
    assert result is not None and result.sums is None and result.threshold == 4  # t(5) = 3 < 4


class _Rank0:
    rank, world_size = 0, 1


def _class_row_entry():
    """A stand-in algorithm entry whose server sums two class rows of three entries."""

    class Server:
        @staticmethod
        def summed_fields(context):
            return {"row_sums": (2, 3), "weights": (2,)}

        @staticmethod
        def contribution(context, upload):
            return {"row_sums": torch.zeros(2, 3, dtype=torch.float64), "weights": torch.tensor([0.0, 1.0])}

    class Entry:
        name, server = "fedproto", Server

    return Entry()


@pytest.mark.parametrize("noise", ["secure", "seeded"])
def test_the_filler_is_drawn_from_the_release_source_not_the_seed(noise):
    """One contribution made twice (same client, round and seed): under privacy.noise=secure the
    unreleased row's filler differs (the OS's randomness), under seeded it repeats (what a build
    that seeded the filler would do in every run, and what the check must tell apart)."""
    from types import SimpleNamespace

    from htfl_dist.resolution import resolved_config
    from htfl_dist.runtime.secure_exchange import SecureSums

    privacy = resolved_config(str(SMOKE), [*DISTRIBUTED, f"privacy.noise={noise}"]).privacy
    sums = SecureSums(_Rank0(), _class_row_entry(), SimpleNamespace(seed=0), privacy, str,  # type: ignore[arg-type]
                      contributors=4, filler_std=0.2)
    first, second = (sums._contribution({}, client_id=3, round_index=1)["row_sums"] for _ in range(2))
    assert torch.equal(first[1], torch.zeros(3)) and bool((first[0] != 0).all())
    assert torch.equal(first, second) == (noise == "seeded")


def _noise_free(sums: torch.Tensor, counts: torch.Tensor, min_count: int) -> torch.Tensor:
    """A client's contribution without noise: its released classes' means, zeros elsewhere."""
    sums, counts = sums.detach().double().cpu(), counts.detach().double().cpu()
    clean = torch.zeros_like(sums)
    released = counts >= min_count
    clean[released] = sums[released] / counts[released, None]
    return clean


@pytest.fixture
def distributed_view(monkeypatch):
    """Each round's unmasked row sums on the server and the same sums without any noise (every
    client's released means, recomputed from what the trainer was given), and client 0's masked
    vectors as rank 0 receives them."""
    from htfl_dist.algorithms.class_rows import ClassMeanServer
    from htfl_dist.privacy import secure_aggregation as secagg
    from htfl_dist.privacy import trainer
    from htfl_dist.privacy.secagg_server import SecAggServer

    view: dict[str, list] = {"clean": [], "unmasked": [], "masked": [], "released": []}
    release, update, receive = trainer.noisy_class_means, ClassMeanServer.update_from_sums, \
        SecAggServer.receive_masked_input

    def spy_release(sums, counts, **kwargs):
        clean = _noise_free(sums, counts, kwargs["min_count"])
        view["clean"].append(clean)
        ids, rows = release(sums, counts, **kwargs)
        view["released"].append(rows.double() - clean[ids])  # the release's own noise
        return ids, rows

    def spy_update(self, sums, *args, **kwargs):
        view["unmasked"].append(sums["row_sums"].double().clone())
        return update(self, sums, *args, **kwargs)

    def spy_receive(self, message):
        if message.client_id == 0:
            view["masked"].append(message.masked.copy())
        return receive(self, message)

    monkeypatch.setattr(trainer, "noisy_class_means", spy_release)
    monkeypatch.setattr(ClassMeanServer, "update_from_sums", spy_update)
    monkeypatch.setattr(SecAggServer, "receive_masked_input", spy_receive)
    assert secagg.SecAggClient  # the protocol the view goes through
    return view


@pytest.mark.integration
def test_a_distributed_run_releases_sums_with_the_central_noise(tmp_path, cache_dir, distributed_view):
    """Smoke config, 6 clients, 2 rounds, t = 4: every unmasked sum's noise (the sum minus the
    clients' noise-free means) has std σB·√(6/4) (all six contribute noise to every row: their
    releases or the filler), at least the central σB; client 0's masked vectors pass the χ²
    uniformity test of test_secure_exchange; a second run of the same seed releases other sums
    (the noise is not the seed's)."""
    import json

    from test_secure_exchange import _uniformity_p_value

    from htfl_dist.runtime.simulate import simulate

    overrides = [f"data.cache_dir={cache_dir}", "rounds=2", "data.subsample=0.01", *DISTRIBUTED]
    rows = simulate(SMOKE, overrides, out=tmp_path / "a")
    plan = json.loads((tmp_path / "a" / "summary.json").read_text())["privacy"]
    sigma_b = plan["guarantees"]["sum_noise_std_at_least"]
    assert sigma_b == pytest.approx(plan["noise_multiplier"] * 0.2)  # B = 2·1/10
    view = distributed_view
    assert len(view["unmasked"]) == 2 and len(view["clean"]) == 12
    for round_index, unmasked in enumerate(view["unmasked"]):
        clean = torch.stack(view["clean"][6 * round_index: 6 * round_index + 6]).sum(0)
        noise = (unmasked - clean).flatten()  # 5,120 entries: the std's relative error ≈ 1 %
        assert float(noise.std()) == pytest.approx(sigma_b * math.sqrt(6 / 4), rel=0.05)
        assert float(noise.std()) > sigma_b
    assert _uniformity_p_value(view["masked"]) > 1e-3
    assert [row["secagg_clipped"] for row in rows] == [0, 0]
    first, releases = [sums.clone() for sums in view["unmasked"]], list(view["released"])
    view["unmasked"].clear()
    view["released"].clear()
    simulate(SMOKE, overrides, out=tmp_path / "b")
    assert all(float((a - b).abs().max()) > 0.1 for a, b in zip(first, view["unmasked"], strict=True))
    # each client's own release noise differs too (not only the unreleased rows' share): round 1,
    # the same classes; a seeded release would repeat its noise to float32 rounding (~1e-7)
    assert all(a.shape == b.shape and float((a - b).abs().max()) > 0.01
               for a, b in zip(releases[:6], view["released"][:6], strict=True))


def test_the_uniformity_check_the_run_reuses_refuses_unmasked_words():
    """The χ² helper the run above reuses refuses words that are not masked (quantised values lie
    below 2^23, as in test_secure_exchange.test_the_check_catches_a_build_without_masks)."""
    from test_secure_exchange import _uniformity_p_value

    rng = np.random.default_rng(0)
    assert _uniformity_p_value([rng.integers(0, 2 ** 23, 5000, dtype=np.uint32)]) < 1e-12


@pytest.mark.integration
def test_a_replayed_distributed_round_resends_each_release_and_charges_it_once(tmp_path, cache_dir, monkeypatch):
    """Killed after round 3's sum was unmasked and before its checkpoint, resumed: every client's
    release of round 3 (its rows with their share σB/√t of the noise) is re-sent exactly, ε is
    unchanged; the sum is unmasked again (its unreleased rows' share is drawn afresh)."""
    import json
    import shutil

    from htfl_dist.privacy.trainer import PrivateTrainer
    from htfl_dist.runtime import loop
    from htfl_dist.runtime.transport import LocalTransport

    released: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    original = PrivateTrainer.release_class_means

    def recording(self, sums, counts):
        ids, rows = original(self, sums, counts)
        released[(self.ledger.client_id, self.ledger.round_index)] = (ids.clone(), rows.clone())
        return ids, rows

    monkeypatch.setattr(PrivateTrainer, "release_class_means", recording)
    out = tmp_path / "run"
    config = checked_config(str(SMOKE), [f"data.cache_dir={cache_dir}", *DISTRIBUTED, "rounds=3",
                                         "data.subsample=0.01", "checkpoint_every=1", "checkpoint_keep=3",
                                         "eval_every=3"])

    def play(resume_from):
        loop.start(loop.RunContext(config, LocalTransport(), torch.device("cpu"), out, resume_from)).run()
        return json.loads((out / "summary.json").read_text())["privacy"]["epsilon_max"]

    epsilon = play(None)
    whole = dict(released)
    assert sorted({r for _, r in whole}) == [0, 1, 2]
    shutil.rmtree(out / "checkpoints" / "round_00003")  # the kill: round 3's sum left, never checkpointed
    released.clear()
    assert play(out) == epsilon
    assert sorted(released) == sorted(key for key in whole if key[1] == 2)
    for key, (ids, rows) in released.items():
        assert torch.equal(ids, whole[key][0]) and torch.equal(rows, whole[key][1])


@pytest.mark.launch
def test_three_ranks_run_the_distributed_split(tmp_path, cache_dir):
    """Rank 0 relays the protocol between two client ranks over Gloo; each client's share of the
    noise (its release and its unreleased rows) is drawn on its own rank. What does not depend on
    the noise is one process's: ε, the classes released, nothing clipped."""
    from conftest import run_smoke

    overrides = ("rounds=1", "data.subsample=0.01", *DISTRIBUTED)
    rows = run_smoke("torchrun", 3, tmp_path / "ranks", cache_dir, *overrides)
    alone = run_smoke("single", 1, tmp_path / "single", cache_dir, *overrides)
    for launched, single in zip(rows, alone, strict=True):
        assert launched["epsilon_max"] == single["epsilon_max"]
        assert launched["global_classes"] == single["global_classes"] and launched["secagg_clipped"] == 0
