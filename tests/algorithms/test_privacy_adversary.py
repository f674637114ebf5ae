"""privacy.* against the adversary docs/privacy.md names (the server, its operator, the other
clients), tried as that adversary would: the audit's attack on rank 0's stored uploads (regenerate
the noise from the config, subtract it), the same on DP-SGD's noise, a replay of the run from its
config (which reproduces any noise derived from what the attacker holds), the secret noise source,
what a private client's rank sends, a budget no noise reaches, and the doc's wire table against
the code."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from htfl_dist.algorithms import get_algorithm
from htfl_dist.config import config_from_dict
from htfl_dist.data.prepare import prepare_partition
from htfl_dist.errors import ProtocolError
from htfl_dist.privacy.noise import SecureNoise, SeededNoise, secure_bits, secure_standard_normal, seeded_noise_key
from htfl_dist.privacy.startup import private_algorithms
from htfl_dist.runtime import exchange as exchange_module
from htfl_dist.runtime.screening import check_rank_report
from tests.conftest import REPO, SMOKE, run_program
from tests.helpers import make_context

pytest.importorskip("opacus")

PRIVATE_ROUND = ("privacy.enabled=true", "privacy.target_epsilon=4", "rounds=1", "data.subsample=0.01",
                 "output.prototypes_every=1")
"""One private FedProto round of the smoke config, rank 0 keeping the round's uploads (what the
server's operator holds)."""


SGD_STEPS_KEPT, SGD_VALUES_KEPT = 3, 256
"""Of each client's DP-SGD noise: the first steps kept, and of each parameter's draw in a step the
first values (enough to tell independent standard normals from equal ones, little to hold)."""


class SgdNoise:
    """The Gaussian noise DP-SGD added in a client's first steps, in units of its standard
    deviation, as it came out of the optimizer (``steps``: per step, per parameter, the first
    values), and the shapes of the parameters it was drawn for, in order."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []
        self.shapes: list[tuple[int, ...]] = []

    def flat(self) -> torch.Tensor:
        return torch.cat([torch.cat(step) for step in self.steps])


class PrivateRound:
    """A played private round: its run directory, the clean class means each client's release
    started from (client id → class id → row, taken inside the client before the noise), the
    report rows each client's rank sent (client id → the kinds of rows present) and the noise of
    each client's first DP-SGD steps (client id → ``SgdNoise``)."""

    def __init__(self, run_dir: Path, clean: dict[int, dict[int, torch.Tensor]], reported: dict[int, set[str]],
                 sgd_noise: dict[int, SgdNoise]):
        self.run_dir, self.clean, self.reported, self.sgd_noise = run_dir, clean, reported, sgd_noise


def _play(run_dir: Path, cache_dir: Path, noise: str, monkeypatch: pytest.MonkeyPatch) -> PrivateRound:
    """One private round with spies: the clean rows before the release's noise, the kinds of report
    rows, and DP-SGD's noise read off the gradient where Opacus's optimizer has added it (the
    noised sum minus the clipped sum, before the scaling), whatever source it came from."""
    from opacus.optimizers import DPOptimizer

    from htfl_dist.privacy.accounting import PrivacyLedger
    from htfl_dist.privacy.trainer import PrivateTrainer  # imports Opacus
    from htfl_dist.runtime.simulate import simulate

    clean: dict[int, dict[int, torch.Tensor]] = {}
    reported: dict[int, set[str]] = {}
    sgd_noise: dict[int, SgdNoise] = {}
    training: list[int] = []  # the client whose DP-SGD pass is running
    release, gather = PrivateTrainer.release_class_means, exchange_module.Exchange.gather_reports
    open_mechanism, scale_grad = PrivacyLedger.open_mechanism, DPOptimizer.scale_grad

    def spy_open(ledger, mechanism):
        if mechanism == "sgd":
            training[:] = [ledger.client_id]
        return open_mechanism(ledger, mechanism)

    def spy_scale(optimizer):
        kept = sgd_noise.setdefault(training[0], SgdNoise())
        if len(kept.steps) < SGD_STEPS_KEPT:
            std = optimizer.noise_multiplier * optimizer.max_grad_norm
            kept.shapes = [tuple(p.shape) for p in optimizer.params]
            kept.steps.append([((p.grad - p.summed_grad.view_as(p)) / std).flatten()[:SGD_VALUES_KEPT].double()
                               for p in optimizer.params])
        return scale_grad(optimizer)

    def spy_release(trainer, sums, counts):
        ledger = trainer.ledger
        minimum = ledger.plan.min_class_samples
        clean[ledger.client_id] = {c: (sums[c] / counts[c]).double() for c in range(len(counts))
                                   if counts[c] >= minimum}
        return release(trainer, sums, counts)

    def spy_gather(self, clients, *args, **kwargs):
        for client_id, report in clients.items():
            reported[client_id] = {name for name, rows in (("train", report.train), ("eval", report.evaluation),
                                                           ("privacy", report.epsilon)) if rows is not None}
        return gather(self, clients, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(PrivateTrainer, "release_class_means", spy_release)
        patch.setattr(exchange_module.Exchange, "gather_reports", spy_gather)
        patch.setattr(PrivacyLedger, "open_mechanism", spy_open)
        patch.setattr(DPOptimizer, "scale_grad", spy_scale)
        simulate(SMOKE, [f"data.cache_dir={cache_dir}", *PRIVATE_ROUND, f"privacy.noise={noise}"], out=run_dir)
    return PrivateRound(run_dir, clean, reported, sgd_noise)


PLAYS = {"secure": "secure", "seeded": "seeded", "replay": "secure"}
"""The rounds played (name → privacy.noise): ``replay`` is the default run played again from the
same config, as an attacker holding config.yaml and the code can."""


@pytest.fixture(scope="module")
def played(tmp_path_factory, cache_dir) -> dict[str, PrivateRound]:
    """The same private round with the secret noise (the default), with seeded noise, and with the
    secret noise once more."""
    patch = pytest.MonkeyPatch()
    try:
        return {name: _play(tmp_path_factory.mktemp(name), cache_dir, noise, patch) for name, noise in PLAYS.items()}
    finally:
        patch.undo()


def strip_seeded_noise(run_dir: Path) -> dict[tuple[int, int], torch.Tensor]:
    """The attack of the audit, with what the server's operator holds: config.yaml (the seed, S,
    the plan), summary.json (σ), rank 0's snapshot of the round-1 uploads and the public split
    (the class counts, a function of the config). Each client's release noise is regenerated as
    a seeded run draws it, scaled by σ·2S/n_c and subtracted. Returns (client, class) → the row
    the attacker believes is the clean mean."""
    config = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    sigma = json.loads((run_dir / "summary.json").read_text())["privacy"]["noise_multiplier"]
    snapshot = torch.load(run_dir / "prototypes" / "round_00001.pt", weights_only=True)
    counts = prepare_partition(config.data, config.num_clients, config.seed).class_counts
    release_number = config.train.local_epochs  # the round's DP-SGD epochs are recorded before the release
    recovered = {}
    for client, label, row in zip(snapshot["upload_client_ids"].tolist(), snapshot["upload_class_ids"].tolist(),
                                  snapshot["upload_protos"], strict=True):
        key = seeded_noise_key(config.seed, "release", client, 0, release_number)
        draws = SeededNoise(key).standard_normal((counts.shape[1], row.shape[0]))
        scale = sigma * 2 * config.privacy.feature_clip / counts[client, label]
        recovered[(client, label)] = row.double() - scale * draws[label]
    return recovered


def _noise_scale(run_dir: Path, client: int, label: int) -> float:
    config = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    sigma = json.loads((run_dir / "summary.json").read_text())["privacy"]["noise_multiplier"]
    counts = prepare_partition(config.data, config.num_clients, config.seed).class_counts
    return sigma * 2 * config.privacy.feature_clip / float(counts[client, label])


def test_the_attack_recovers_every_clean_mean_of_a_seeded_run(played):
    """The attack works where it must: with privacy.noise=seeded every uploaded row minus the
    regenerated noise is the client's clean class mean (float32 rounding apart), which is why
    such a run says it is not private against the server."""
    run = played["seeded"]
    recovered = strip_seeded_noise(run.run_dir)
    assert len(recovered) >= 10 and set(recovered) == {(c, k) for c, rows in run.clean.items() for k in rows}
    for (client, label), row in recovered.items():
        assert float((row - run.clean[client][label]).abs().max()) < 1e-4, (client, label)
    assert (run.run_dir / "summary.json").read_text().count('"private_against_server": false') == 1


def test_the_attack_fails_on_a_default_private_run(played):
    """The same attack on a default run leaves, in every row, an error of the order of the noise
    (the attacker's draw and the real one are independent: about √2 · σ·2S/n_c per coordinate),
    never the clean mean."""
    run = played["secure"]
    recovered = strip_seeded_noise(run.run_dir)
    assert len(recovered) >= 10 and set(recovered) == {(c, k) for c, rows in run.clean.items() for k in rows}
    for (client, label), row in recovered.items():
        error = row - run.clean[client][label]
        per_coordinate = float(error.norm()) / error.numel() ** 0.5
        assert per_coordinate > 0.8 * _noise_scale(run.run_dir, client, label), (client, label)
    assert (run.run_dir / "summary.json").read_text().count('"private_against_server": true') == 1


def _release_noise(run: PrivateRound) -> dict[tuple[int, int], torch.Tensor]:
    """(client, class) → the noise of that released row, in units of its standard deviation: the
    row rank 0 kept minus the clean mean the client started from, over σ·2S/n_c."""
    snapshot = torch.load(run.run_dir / "prototypes" / "round_00001.pt", weights_only=True)
    return {(client, label): (row.double() - run.clean[client][label]) / _noise_scale(run.run_dir, client, label)
            for client, label, row in zip(snapshot["upload_client_ids"].tolist(), snapshot["upload_class_ids"].tolist(),
                                          snapshot["upload_protos"], strict=True)}


def _seeded_sgd_draws(run: PrivateRound, client: int) -> torch.Tensor:
    """What a seeded run's first DP-SGD step of ``client`` in round 1 draws (its stream's key from
    the config's seed; the client's first mechanism, release number 0), cut as the spy keeps it."""
    config = config_from_dict(yaml.safe_load((run.run_dir / "config.yaml").read_text()))
    stream = SeededNoise(seeded_noise_key(config.seed, "sgd", client, 0, 0))
    return torch.cat([stream.standard_normal(shape, dtype=torch.float32).flatten()[:SGD_VALUES_KEPT].double()
                      for shape in run.sgd_noise[client].shapes])


def _alike(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two draws are the same noise: equal within float32 rounding of the gradients they
    were read from. Independent standard normals of a few hundred values differ by more than 1
    somewhere with probability 1 − 1e-100."""
    return first.shape == second.shape and float((first - second).abs().max()) < 1e-2


def test_the_attack_regenerates_the_dpsgd_noise_of_a_seeded_run_only(played):
    """The audit's attack on DP-SGD: regenerate each client's first step of noise from the seed in
    config.yaml. It works on a seeded run (so the spy reads the noise right), and on a default run
    it finds none of it: DP-SGD's noise is not drawn from the seed either."""
    for name, works in (("seeded", True), ("secure", False)):
        run = played[name]
        assert sorted(run.sgd_noise) == list(range(6)), name
        for client, noise in run.sgd_noise.items():
            assert len(noise.steps) == SGD_STEPS_KEPT
            assert _alike(torch.cat(noise.steps[0]), _seeded_sgd_draws(run, client)) == works, (name, client)


def test_an_attacker_replaying_the_config_reproduces_no_noise(played):
    """The attacker holds config.yaml and the code, so anything derived from them (the seed, a key
    hashed from the config, the client and the round) it reproduces by running the same round
    again: every mechanism's noise would come out the same. In the default run none does: each
    client's DP-SGD steps and each released row carry noise unrelated to the replay's (and each
    is a standard normal draw), so the noise is not a function of anything the attacker holds."""
    run, replay = played["secure"], played["replay"]
    assert set(run.sgd_noise) == set(replay.sgd_noise) == set(range(6))
    for client in run.sgd_noise:
        for step, (mine, theirs) in enumerate(zip(run.sgd_noise[client].steps, replay.sgd_noise[client].steps,
                                                  strict=True)):
            assert not _alike(torch.cat(mine), torch.cat(theirs)), (client, step)
        draws = run.sgd_noise[client].flat()
        assert abs(float(draws.std()) - 1) < 0.1 and abs(float(draws.mean())) < 0.1, client
    rows, replayed = _release_noise(run), _release_noise(replay)
    assert set(rows) == set(replayed) and len(rows) >= 10
    for key, noise in rows.items():
        assert not _alike(noise, replayed[key]), key
    pooled = torch.cat(list(rows.values()))
    assert abs(float(pooled.std()) - 1) < 0.1 and abs(float(pooled.mean())) < 0.1


def test_a_private_clients_rank_reports_no_training_loss_or_count(played):
    """Finding 2 of the audit: each client's raw training-loss sum and sample count reached rank
    0. A private client's rank now sends evaluation (test split) and ε rows only; rank 0 records
    the loss as absent and says why."""
    for run in played.values():
        assert run.reported and all(kinds == {"eval", "privacy"} for kinds in run.reported.values())
        rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows and all(row["train_loss"] is None for row in rows)
        summary = json.loads((run.run_dir / "summary.json").read_text())
        assert "stay on the client" in summary["privacy"]["withheld"]["train_loss"]


def test_rank0_refuses_a_training_row_for_a_private_client():
    """A rank that sends a private client's training row anyway is refused, naming the client."""
    entry = {"train": torch.tensor([[30.68, 12.0]], dtype=torch.float64), "eval": torch.zeros(0, 4),
             "privacy": torch.tensor([[1.0]], dtype=torch.float64)}
    with pytest.raises(ProtocolError, match=re.escape("reported training for clients [5] and evaluation for [], "
                                                      "expected [] and []")):
        check_rank_report({5: entry}, [], [], epsilon_budget=4.0)


def test_the_report_says_why_a_private_run_has_no_training_loss(played, tmp_path, capsys):
    from htfl_dist.report import main as report_main

    run_dir = played["secure"].run_dir
    assert report_main([str(run_dir), "--metric", "train_loss"]) == 2
    assert "is not recorded in" in capsys.readouterr().err
    public = tmp_path / "public"
    public.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        text = (run_dir / name).read_text()
        if name == "metrics.jsonl":
            text = text.replace('"train_loss": null', '"train_loss": 1.5')
        else:
            text = text.replace("enabled: true", "enabled: false")
        (public / name).write_text(text)
    assert report_main([str(run_dir), str(public), "--metric", "train_loss", "--plot", str(tmp_path / "l.png")]) == 0
    err = capsys.readouterr().err
    assert f"no train_loss curve for {run_dir.name}: a private client's training loss" in err
    assert (tmp_path / "l.png").stat().st_size > 0


# --------------------------------------------------------------------------- the noise source


def test_secret_noise_is_standard_normal():
    """200 000 draws: mean, standard deviation, tails and the Kolmogorov–Smirnov distance of a
    standard normal, with bounds that fail by chance with probability below 1e-6 each."""
    from scipy import stats

    n = 200_000
    draws = secure_standard_normal(n).numpy()
    assert draws.dtype == np.float64 and draws.shape == (n,)
    assert abs(draws.mean()) < 5.3 / n**0.5
    assert abs(draws.std() - 1) < 5.3 / (2 * n) ** 0.5
    assert stats.kstest(draws, "norm").statistic < 2.8 / n**0.5
    beyond_three = float((np.abs(draws) > 3).mean())
    assert abs(beyond_three - 0.0026998) < 5.3 * (0.0027 / n) ** 0.5
    halves = secure_standard_normal(n)
    assert abs(float(np.corrcoef(halves[: n // 2].numpy(), halves[n // 2 :].numpy())[0, 1])) < 5.3 / (n / 2) ** 0.5


def test_secret_noise_never_repeats_and_has_no_seed():
    """Two sources, or two draws of one, never give the same bits: no key is derived from
    anything a run shares (the seed, the client, the round)."""
    assert not torch.equal(secure_bits(4), secure_bits(4))
    source = SecureNoise()
    assert not torch.equal(source.standard_normal((3, 5)), source.standard_normal((3, 5)))
    assert source.standard_normal((2, 3), dtype=torch.float32).dtype == torch.float32
    assert source.standard_normal((0, 7)).shape == (0, 7) and secure_standard_normal(3).shape == (3,)


@pytest.mark.integration
def test_a_large_draw_never_runs_out_of_keystream(monkeypatch):
    """Whatever the OS hands out (here every byte 0xff, which as a ChaCha20 block counter would be
    one block from its end), a draw of a million coordinates succeeds: the counter starts at 0."""
    from htfl_dist.privacy import noise

    monkeypatch.setattr(noise.os, "urandom", lambda count: b"\xff" * count)
    assert secure_bits(1_000_000).shape == (1_000_000,)
    assert torch.isfinite(secure_standard_normal(1001)).all()


def test_a_world_size_check_of_a_secret_run_compares_what_the_noise_does_not_touch(played):
    """Two default private runs of one config (what two world sizes give as well: the noise is
    keyed by nothing a rank shares) agree on ε, which classes were released and the bytes sent,
    and differ in the noised rows."""
    first, again = played["secure"].run_dir, played["replay"].run_dir
    before, after = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                     for run in (first, again))
    for key in ("epsilon_max", "epsilon_median", "global_classes", "bytes_theory_up", "skipped_clients"):
        assert [row[key] for row in before] == [row[key] for row in after], key
    snapshots = [torch.load(directory / "prototypes" / "round_00001.pt", weights_only=True)
                 for directory in (first, again)]
    assert torch.equal(snapshots[0]["upload_class_ids"], snapshots[1]["upload_class_ids"])
    assert not torch.equal(snapshots[0]["upload_protos"], snapshots[1]["upload_protos"])


# --------------------------------------------------------------------------- budgets and the doc


def test_a_budget_no_noise_reaches_is_one_line_before_the_data_loads(tmp_path, capsys):
    """ε = 0.05 at δ = 1e-5: the RDP conversion's floor is about 0.103 however large σ is. One
    line naming the smallest reachable ε, exit 2, and no data read (the data root does not exist)."""
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), "privacy.enabled=true",
                          "privacy.target_epsilon=0.05", f"data.root={tmp_path / 'no-such-data'}"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "privacy.target_epsilon=0.05 cannot be reached" in lines[0]
    assert re.search(r"smallest reachable ε for this run's plan is 0\.10\d", lines[0])
    assert "data:" not in result.stderr + result.stdout


def _wire_table() -> dict[str, tuple[set[str], set[str], set[str]]]:
    """docs/privacy.md's table of what a private client sends: algorithm → (upload fields, setup
    fields, report rows)."""
    text = (REPO / "docs" / "privacy.md").read_text()
    table = text.split("<!-- wire-table:", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[3:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = [set(re.findall(r"`([^`]+)`", cell)) for cell in cells[1:]]
        rows[cells[0]] = tuple(names)
    return rows


ACCEPTED_OPTIONS = {"fedsa": {"weighted": False}, "feddistill": {"logits_from": "post_update"}}
"""The options under which privacy accepts these algorithms (their defaults are refused)."""


def test_the_docs_wire_table_lists_every_field_a_private_client_sends(played):
    table = _wire_table()
    assert set(table) == set(private_algorithms())
    for algorithm, (upload, setup, reports) in table.items():
        entry, context = make_context(algorithm, num_classes=10, feature_dim=8, **ACCEPTED_OPTIONS.get(algorithm, {}))
        assert upload == {field.name for field in entry.client.upload_fields(context)}, algorithm
        assert setup == {field.name for field in entry.client.setup_upload_fields(context)}, algorithm
        assert reports == {"eval", "privacy"}, algorithm
    assert get_algorithm("fedproto").private_release
    assert all(kinds == table["fedproto"][2] for kinds in played["secure"].reported.values())
