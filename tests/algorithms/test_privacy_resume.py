"""A resumed private run replays the rounds after its checkpoint: each replayed release must be
the one that left the client before (re-sent from the client's release file, no fresh noise),
and ε must count every release once (docs/privacy.md, "Resumed runs")."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from htfl_dist.privacy.accounting import PrivacyLedger, PrivacyPlan, merged
from htfl_dist.privacy.release_log import RELEASES_DIR, ReleaseLog
from tests.conftest import SMOKE

pytest.importorskip("opacus")

PRIVATE = ("privacy.enabled=true", "privacy.target_epsilon=4", "rounds=3", "data.subsample=0.01",
           "checkpoint_every=1", "checkpoint_keep=3", "eval_every=3")


def _play(out: Path, cache_dir: Path, monkeypatch, resume_from: Path | None = None) -> dict[int, dict]:
    """The private smoke run in this process (resumed from ``resume_from``); the uploads rank 0
    received, by round number and client."""
    from htfl_dist.runtime import loop
    from htfl_dist.runtime.session import checked_config
    from htfl_dist.runtime.transport import LocalTransport

    received: dict[int, dict] = {}
    server_step = getattr(loop.Federation.aggregate, "original", loop.Federation.aggregate)  # not a wrapper

    def recording(self, outcome, gathered, left_out):
        received[outcome.round_index + 1] = {client: {name: value.clone() for name, value in payload.items()}
                                             for client, payload in gathered.items()}
        return server_step(self, outcome, gathered, left_out)

    recording.original = server_step  # type: ignore[attr-defined]
    monkeypatch.setattr(loop.Federation, "aggregate", recording)
    config = checked_config(str(SMOKE), [f"data.cache_dir={cache_dir}", *PRIVATE])
    loop.start(loop.RunContext(config, LocalTransport(), torch.device("cpu"), out, resume_from)).run()
    return received


def _epsilon(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["privacy"]["epsilon_max"]


def _same(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(
        first[c].keys() == second[c].keys() and all(torch.equal(first[c][k], second[c][k]) for k in first[c])
        for c in first)


@pytest.mark.integration
def test_a_replayed_round_resends_its_release_and_epsilon_counts_it_once(tmp_path, cache_dir, monkeypatch):
    """Killed after round 3's uploads left and before its checkpoint (its checkpoint removed),
    resumed: rank 0 receives round 3's rows exactly as before and ε is unchanged. Resumed from
    the round-1 checkpoint: rounds 2 and 3 again the same, ε again unchanged."""
    out = tmp_path / "run"
    whole = _play(out, cache_dir, monkeypatch)
    epsilon = _epsilon(out)
    assert 3.0 < epsilon <= 4.0 and sorted(whole) == [1, 2, 3] and whole[3]
    releases = sorted(out.joinpath(*RELEASES_DIR).glob("client_*/round_*.pt"))
    assert releases, "every private client records its release before it leaves"
    for path in releases:  # exactly what rank 0 received: no key, no noise draw, no training record
        saved = torch.load(path, weights_only=True)
        assert set(saved) == {"client_id", "round", "mechanism", "class_ids", "rows"}
        sent = whole[saved["round"] + 1][saved["client_id"]]
        assert torch.equal(saved["rows"], sent["protos"]) and torch.equal(saved["class_ids"], sent["class_ids"])
    shutil.rmtree(out / "checkpoints" / "round_00003")  # the kill: round 3 sent, never checkpointed

    replayed = _play(out, cache_dir, monkeypatch, resume_from=out)
    assert sorted(replayed) == [3] and _same(replayed[3], whole[3])
    assert _epsilon(out) == epsilon

    older = _play(out, cache_dir, monkeypatch, resume_from=out / "checkpoints" / "round_00001")
    assert sorted(older) == [2, 3] and _same(older[2], whole[2]) and _same(older[3], whole[3])
    assert _epsilon(out) == epsilon


def test_a_release_whose_record_is_lost_is_charged(tmp_path):
    """A release file there but unreadable: the release left, its rows are lost, so the replayed
    round cannot re-send it; that round is charged on top of the new one."""
    plan = PrivacyPlan(noise_multiplier=2.0, target_epsilon=50.0, delta=1e-5, feature_clip=1.0, max_grad_norm=1.0,
                       min_class_samples=1, accountant="rdp", local_epochs=1, seed=0, run_directory=str(tmp_path))
    fresh = PrivacyLedger(plan, client_id=3)
    fresh.begin_round(0)
    assert not fresh.replaying
    cost = plan.round_cost(plan.noise_multiplier)
    log = ReleaseLog(tmp_path, 3)
    log.record(0, torch.tensor([1]), torch.ones(1, 4))
    replay = PrivacyLedger(plan, client_id=3)
    replay.begin_round(0)
    assert replay.replaying and replay.history == ()  # charged when its mechanisms open, as before
    log.path(0).write_bytes(b"not a release")
    lost = PrivacyLedger(plan, client_id=3)
    lost.begin_round(0)
    assert not lost.replaying and lost.history == merged((), cost)


def test_pruning_the_checkpoints_drops_the_releases_no_kept_checkpoint_replays(tmp_path):
    """Checkpoints after rounds 2 and 3 and a partial one after 4, keep 1: round 3's stays, so a
    resume replays 0-based rounds 3 and on; the releases of rounds 0-2 go, of every client, and
    files that are not ours stay."""
    from htfl_dist.runtime import checkpoint

    for completed, complete in ((2, True), (3, True), (4, False)):
        directory = tmp_path / "checkpoints" / f"round_{completed:05d}"
        directory.mkdir(parents=True)
        if complete:
            (directory / "MANIFEST.json").write_text("{}")
    for client_id in (0, 7):
        log = ReleaseLog(tmp_path, client_id)
        for round_index in range(5):
            log.record(round_index, torch.tensor([1]), torch.ones(1, 2))
    stranger = tmp_path.joinpath(*RELEASES_DIR, "client_7", "notes.txt")
    stranger.write_text("mine")
    checkpoint._prune(tmp_path, keep=1)
    for client_id in (0, 7):
        kept = sorted(p.name for p in tmp_path.joinpath(*RELEASES_DIR, f"client_{client_id}").glob("round_*.pt"))
        assert kept == ["round_00003.pt", "round_00004.pt"]
    assert stranger.is_file() and not (tmp_path / "checkpoints" / "round_00002").exists()
