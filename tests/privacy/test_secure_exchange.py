"""Secure aggregation in the program (``privacy.secure_aggregation``): the round's sum reaches
rank 0 through SecAgg+ over the transport and the server steps from it alone. Played as the
attacker would: rank 0's whole view of a client (its masked vector) against what the client
contributed, on this build and on one whose masks are switched off (which the check must catch);
no per-client upload reaches the server; the refusals; the hash; three ranks over Gloo."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SMOKE, read_metrics, run_program, run_smoke
from htfl_dist.errors import ConfigError, NothingAggregated
from htfl_dist.privacy import secagg_quant
from htfl_dist.privacy import secure_aggregation as secagg
from htfl_dist.privacy.secagg_server import SecAggServer
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime import secure_exchange
from htfl_dist.runtime.session import checked_config
from htfl_dist.runtime.simulate import simulate

SECURE = ("privacy.secure_aggregation=true",)


def _play(tmp_path, cache_dir, *overrides, name="run"):
    return simulate(SMOKE, [f"data.cache_dir={cache_dir}", "rounds=2", *overrides], out=tmp_path / name)


@pytest.fixture
def server_view(monkeypatch):
    """What rank 0 receives in stage 2 (every client's masked vector) and each client's quantised
    contribution as the client computed it (what the server must not learn)."""
    seen: dict[int, np.ndarray] = {}
    truth: dict[int, np.ndarray] = {}
    history: list[np.ndarray] = []  # every masked vector of client 0, round after round
    receive, masked_input = SecAggServer.receive_masked_input, secagg.SecAggClient.masked_input

    def spy_receive(self, message):
        seen[message.client_id] = message.masked.copy()
        if message.client_id == 0:
            history.append(message.masked.copy())
        return receive(self, message)

    def spy_input(self, x_quantised, shares):
        truth[self.client_id] = x_quantised.copy()
        return masked_input(self, x_quantised, shares)

    monkeypatch.setattr(SecAggServer, "receive_masked_input", spy_receive)
    monkeypatch.setattr(secagg.SecAggClient, "masked_input", spy_input)
    return seen, truth, history


def _uniformity_p_value(vectors: list[np.ndarray]) -> float:
    """χ² test of the top byte of every word of one client's masked vectors against uniform on
    256 values (a masked word is uniform on 2^32; an unmasked quantised word lies below 2^23)."""
    from scipy.stats import chisquare

    top = np.concatenate([(vector >> np.uint32(24)).astype(np.int64) for vector in vectors])
    return float(chisquare(np.bincount(top, minlength=256)).pvalue)


def _leaked_entries(seen: dict[int, np.ndarray], truth: dict[int, np.ndarray]) -> float:
    """The share of a client's entries the server's view gives away exactly (masked = input)."""
    return max(float(np.mean(seen[cid] == truth[cid])) for cid in truth)


@pytest.mark.integration
def test_the_server_sees_masked_vectors_and_steps_from_the_sum(tmp_path, cache_dir, server_view, monkeypatch):
    from htfl_dist.algorithms.class_rows import ClassMeanServer

    def no_per_client_step(*args, **kwargs):
        raise AssertionError("a per-client server step ran under secure aggregation")

    monkeypatch.setattr(ClassMeanServer, "update", no_per_client_step)
    monkeypatch.setattr(ClassMeanServer, "validate_upload", no_per_client_step)
    rows = _play(tmp_path, cache_dir, *SECURE)
    seen, truth, history = server_view
    assert sorted(seen) == sorted(truth) == list(range(6))  # every participant, every round (the last kept)
    assert _leaked_entries(seen, truth) < 0.01  # uniform masks: ~2^-32 of the entries match by chance
    assert len(history) == 2 and _uniformity_p_value(history) > 1e-3  # 2 rounds of ~5,000 words: uniform
    assert [row["secagg_clipped"] for row in rows] == [0, 0]
    monkeypatch.undo()
    plain = _play(tmp_path, cache_dir, name="plain")
    for secure_row, plain_row in zip(rows, plain, strict=True):  # 2^22 levels over ±8: 4e-6 a step
        assert secure_row["test_acc"] == pytest.approx(plain_row["test_acc"], abs=0.01)
        assert secure_row["train_loss"] == pytest.approx(plain_row["train_loss"], rel=1e-4)


@pytest.mark.integration
def test_the_check_catches_a_build_without_masks(tmp_path, cache_dir, server_view, monkeypatch):
    """The weakened build the attacker test exists for: clients send their quantised input as it
    is (no self mask, no pairwise masks; the server then removes masks that were never added, so
    the sum is wrong too, but the leak comes first): the view gives every entry away."""
    original = secagg.SecAggClient.masked_input

    def unmasked(self, x_quantised, shares):
        message = original(self, x_quantised, shares)
        return secagg.MaskedInput(message.client_id, x_quantised.copy())

    monkeypatch.setattr(secagg.SecAggClient, "masked_input", unmasked)
    _play(tmp_path, cache_dir, *SECURE, "rounds=1")
    seen, truth, history = server_view
    assert _leaked_entries(seen, truth) == 1.0
    assert _uniformity_p_value(history) < 1e-12  # the statistical test refuses it too


def test_contributions_are_quantised_from_the_clients_own_randomness(monkeypatch):
    """Stochastic rounding draws from the OS (secure_uniforms), never from the experiment seed:
    two quantisations of one vector differ, their mean is the vector."""
    x = np.full(4096, 0.123456789)
    a = secagg_quant.quantize(x, 8.0, 1 << 22)
    b = secagg_quant.quantize(x, 8.0, 1 << 22)
    assert not np.array_equal(a, b)
    step = 16.0 / (1 << 22)
    assert abs(float(np.mean(a.astype(np.float64) * step - 8.0)) - 0.123456789) < step / 10


@pytest.mark.parametrize(("overrides", "message"), [
    (("algorithm=fedtgp",), r"^privacy.secure_aggregation: fedtgp's server reads each client's upload, not only "
                            r"their sum .*; the sums-only algorithms are feddistill, fedmrl, fedproto, fml, lgfedavg"),
    (("participation.late=next_round", "participation.deadline_s=5", "participation.clock=true"),
     r"^privacy.secure_aggregation cannot carry a late upload into the next "),
    (("num_clients=2",), r"^privacy.secure_aggregation needs at least 3 participants a round .* gives 2$"),
    (("join_ratio=0.3",), r"gives 1$"),
])
def test_what_secure_aggregation_cannot_run_with_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        checked_config(str(SMOKE), [*SECURE, *overrides])


def test_the_thresholds_and_the_ring():
    """t = ⌊f·holders⌋ + 1, at least 2; holders = k + 1 on a ring, n on the full graph."""
    assert secure_exchange.threshold(6, 0.5) == 4 and secure_exchange.threshold(11, 0.5) == 6
    assert secure_exchange.threshold(3, 0.1) == 2 and secure_exchange.threshold(5, 0.99) == 5
    privacy = resolved_config(None, [*SECURE, "privacy.secagg_neighbours=4"]).privacy
    ring = secure_exchange.protocol_config(privacy, 20)
    assert (ring.neighbours, ring.threshold) == (4, 3)
    full = secure_exchange.protocol_config(privacy, 5)  # k = 4 = n - 1: every pair
    assert (full.neighbours, full.threshold) == (None, 3)


def test_secure_aggregation_is_part_of_the_experiment():
    """It changes the numbers (quantisation, clipping), so it enters the hash though DP is off."""
    plain, secure = resolved_config(None, []), resolved_config(None, list(SECURE))
    assert "privacy" not in plain.experiment() and secure.experiment()["privacy"]["secure_aggregation"] is True
    assert plain.config_hash() != secure.config_hash()


def test_layout_round_trips_the_summed_fields():
    layout = secure_exchange.Layout((("row_sums", (2, 3)), ("weights", (2,))))
    parts = {"row_sums": torch.arange(6.0).reshape(2, 3), "weights": torch.tensor([1.0, 2.0])}
    flat = layout.flatten(parts)
    assert layout.length == 8 and flat.tolist() == [0, 1, 2, 3, 4, 5, 1, 2]
    back = layout.split(flat)
    assert all(torch.equal(back[key], parts[key].double()) for key in parts)


@pytest.mark.launch
def test_three_ranks_sum_securely_as_one_process_does(tmp_path, cache_dir):
    """Rank 0 relays the protocol between two client ranks over Gloo; the rounds match one
    process's (each rounds its own way from the OS, so within the quantisation step)."""
    single = _play(tmp_path, cache_dir, *SECURE, name="single")
    rows = run_smoke("torchrun", 3, tmp_path / "ranks", cache_dir, *SECURE, "rounds=2")
    for launched, alone in zip(rows, single, strict=True):
        assert launched["test_acc"] == pytest.approx(alone["test_acc"], abs=0.01)
        assert launched["secagg_clipped"] == 0


@pytest.mark.integration
def test_a_secure_run_checkpoints_and_resumes(tmp_path, cache_dir):
    """Killed after round 2's checkpoint (here: a 2-round run), resumed to 3 rounds: round 3 runs
    its own secure sum from the restored server (keys and masks are per round: nothing to restore)."""
    args = ["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}", *SECURE,
            "checkpoint_every=1"]
    first = run_program([*args, "rounds=2"])
    assert first.returncode == 0, first.stderr
    again = run_program([*args, "rounds=3", "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    rows = read_metrics(tmp_path)
    assert [row["round"] for row in rows] == [1, 2, 3] and rows[-1]["secagg_clipped"] == 0
    assert rows[-1]["test_acc"] > 0.3


@pytest.mark.integration
def test_clients_that_drop_after_masking_are_unmasked_without_their_inputs(tmp_path, cache_dir):
    """participation.drop_rate: the masked inputs that do not arrive count as dropped; the others'
    shares of their masking keys remove their pairwise masks (their self masks stay secret), and
    the sum over those that arrived equals a plain run's with the same (seeded) drop-outs. With
    the threshold at t = 2 of 6 holders, the 3 of 6 that arrive suffice."""
    dropping = ("participation.drop_rate=0.34", "rounds=3")
    rows = _play(tmp_path, cache_dir, *SECURE, *dropping, "privacy.secagg_threshold=0.3")
    plain = _play(tmp_path, cache_dir, *dropping, name="plain")
    dropped = [len(row["dropped_clients"]) if isinstance(row["dropped_clients"], list) else row["dropped_clients"]
               for row in rows]
    assert [row["dropped_clients"] for row in rows] == [row["dropped_clients"] for row in plain] and sum(dropped) > 0
    for secure_row, plain_row in zip(rows, plain, strict=True):
        assert "server_skipped" not in secure_row
        assert secure_row["test_acc"] == pytest.approx(plain_row["test_acc"], abs=0.01)


@pytest.mark.integration
def test_fewer_arrivals_than_the_threshold_release_nothing(tmp_path, cache_dir, capsys):
    """t = 4 of 6 holders (a strict majority) and 3 arrive: no sum is unmasked, the server keeps its
    knowledge and the round says so; the run goes on."""
    with pytest.raises(NothingAggregated):  # no round of the run aggregated: said, non-zero exit
        _play(tmp_path, cache_dir, *SECURE, "participation.drop_rate=0.34", "rounds=2")
    assert all(row.get("server_skipped") is True for row in read_metrics(tmp_path / "run"))
    said = capsys.readouterr().err
    assert "round 1: secure aggregation unmasks nothing: fewer masked inputs arrived than its threshold t=4" in said


@pytest.mark.integration
def test_the_overhead_bench_runs_at_a_tiny_size(tmp_path, cache_dir):
    """bench/secagg_overhead.py's three modes on the smoke federation: same accuracy (within the
    quantisation), more bytes up for the secure ones (keys, shares, the dense sums)."""
    import json
    import subprocess
    import sys

    from conftest import REPO
    out = tmp_path / "secagg.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "secagg_overhead.py"), "--federations", "6:1.0",
                    "--rounds", "1", "--subsample", "0.02", "--neighbours", "2", "--cache-dir", str(cache_dir),
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    assert sorted(rows) == ["plain", "secagg", "secagg+ k=2"]
    assert all(abs(row["acc_difference"]) <= 0.01 and row["clipped"] == 0 for row in rows.values())
    assert rows["secagg"]["bytes_up"] > rows["plain"]["bytes_up"]
