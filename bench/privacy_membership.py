"""Membership inference on uploaded prototypes, against ε (docs/privacy.md, "Threat model").

The attacker is the server, made stronger than the threat model needs: besides client i's
uploaded prototype P_i^c of the last round it holds client i's final model f_i (a DP-SGD model
is covered by the same ledger, so the guarantee still bounds this attacker). For a candidate
sample (x, c) it scores d = ‖f_i(x) − P_i^c‖ (the feature clipped to S first when the release
clipped it): a training sample of client i (member) should sit nearer its class prototype than a
sample of the same client and class that it never trained on (its test split: non-member, same
distribution). Reported per ε, pooled over clients, classes and seeds:

- AUC of −d for members against non-members (0.5: no information), and
- the advantage max over thresholds of TPR − FPR (0: no information; (ε, δ)-DP bounds it by
  (e^ε − 1 + 2δ) / (e^ε + 1) for one sample),

both on the raw distance (one threshold for every class) and on the distance divided by the median
distance of the class's candidates (members and non-members together, which the attacker may
hold), which removes the scale differences between classes and clients. "small classes" repeats
the per-class score on classes with fewer than 20 training samples, where one sample weighs most
in a mean. Only classes with at least 10 training samples (``privacy.min_class_samples``) are
attacked at every ε, privacy off included, so every row attacks the same samples. The advantage is
a maximum over thresholds, so it is above 0 even without any signal; "chance" is its mean when the
member / non-member labels are shuffled within each class (same sizes, 50 shuffles): an advantage
is only a finding above that.

    python bench/privacy_membership.py --out runs/privacy_bench

It attacks the FedProto cells of ``bench/privacy_utility.py`` (the same directories; missing
cells are run first, with that script's settings).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from privacy_utility import REPO, cell_dir, read_rows, run_cell

SMALL_CLASS = 20
MIN_CLASS = 10
"""The default privacy.min_class_samples: smaller classes are uploaded only with privacy off."""


def auc(members: np.ndarray, others: np.ndarray) -> float:
    """P(score of a member > score of a non-member) + ½ P(tie): the Mann-Whitney statistic."""
    scores = np.concatenate([members, others])
    ranks = _average_ranks(scores)
    return float((ranks[: members.size].sum() - members.size * (members.size + 1) / 2) / (members.size * others.size))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(values.size)
    ranks[order] = np.arange(1, values.size + 1)
    unique, inverse = np.unique(values, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    counts = np.bincount(inverse)
    return (sums / counts)[inverse] if unique.size < values.size else ranks


def advantage(members: np.ndarray, others: np.ndarray) -> float:
    """max over thresholds t of P(member score ≥ t) − P(non-member score ≥ t)."""
    thresholds = np.unique(np.concatenate([members, others]))
    tpr = 1.0 - np.searchsorted(np.sort(members), thresholds, side="left") / members.size
    fpr = 1.0 - np.searchsorted(np.sort(others), thresholds, side="left") / others.size
    return float(max(0.0, (tpr - fpr).max()))


def dp_advantage_bound(epsilon: float, delta: float) -> float:
    """What (ε, δ)-DP allows an attacker on one sample: (e^ε − 1 + 2δ) / (e^ε + 1)."""
    return 1.0 if math.isinf(epsilon) else (math.exp(epsilon) - 1 + 2 * delta) / (math.exp(epsilon) + 1)


def run_scores(run_dir: Path) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Per (client, uploaded class): (member scores, non-member scores, training samples of the
    class), scores = −distance to the uploaded prototype of the last round."""
    import torch

    from htfl_dist.data.cache import load_client_split
    from htfl_dist.data.prepare import prepare_partition
    from htfl_dist.metrics.prototypes import load_snapshot
    from htfl_dist.models import initial_client_model
    from htfl_dist.privacy.release import clip_rows
    from htfl_dist.resolution import resolved_config

    config = resolved_config(str(run_dir / "config.yaml"), [])
    info = prepare_partition(config.data, config.num_clients, config.seed, batch_size=config.train.batch_size)
    snapshot = load_snapshot(run_dir, config.rounds)
    checkpoint = run_dir / "checkpoints" / f"round_{config.rounds:05d}"
    clip = config.privacy.feature_clip if config.privacy.enabled else None
    groups = []
    for client_id in range(config.num_clients):
        record = torch.load(checkpoint / f"client_{client_id}.pt", map_location="cpu", weights_only=True)
        model = initial_client_model(config.model.group, client_id, config.seed, num_classes=info.num_classes,
                                     feature_dim=config.model.feature_dim, in_channels=info.in_channels,
                                     image_size=info.image_size, init=config.model.init)
        model.load_state_dict(record["model"])
        model.eval()
        split = load_client_split(info.path, client_id)
        with torch.no_grad():
            train_features, test_features = model.features(split.train_x), model.features(split.test_x)
        if clip is not None:
            train_features, test_features = clip_rows(train_features, clip), clip_rows(test_features, clip)
        mine = snapshot["upload_client_ids"] == client_id
        for class_id, proto in zip(snapshot["upload_class_ids"][mine].tolist(), snapshot["upload_protos"][mine],
                                   strict=True):
            members = train_features[split.train_y == class_id]
            others = test_features[split.test_y == class_id]
            if members.shape[0] >= MIN_CLASS and others.shape[0]:
                groups.append((-(members - proto).norm(dim=1).numpy(), -(others - proto).norm(dim=1).numpy(),
                               int(members.shape[0])))
    return groups


def shuffled(groups: list[tuple[np.ndarray, np.ndarray, int]], rng: np.random.Generator
             ) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The same groups with the member / non-member labels drawn at random (sizes kept)."""
    result = []
    for m, o, n in groups:
        scores = rng.permutation(np.concatenate([m, o]))
        result.append((scores[: m.size], scores[m.size :], n))
    return result


def summarise(groups: list[tuple[np.ndarray, np.ndarray, int]]) -> dict[str, float]:
    small = [g for g in groups if g[2] < SMALL_CLASS]
    rng = np.random.default_rng(0)
    chance = [(pooled(shuffled(groups, rng), True)[1], pooled(shuffled(small, rng), True)[1]) for _ in range(50)]
    raw_auc, raw_adv, members, others = pooled(groups, False)
    class_auc, class_adv, _, _ = pooled(groups, True)
    small_auc, small_adv, small_members, small_others = pooled(small, True)
    return {"members": members, "non_members": others, "auc_raw": raw_auc, "adv_raw": raw_adv,
            "auc_class": class_auc, "adv_class": class_adv, "chance_class": float(np.mean([c[0] for c in chance])),
            "small_members": small_members, "small_non_members": small_others, "auc_small": small_auc,
            "adv_small": small_adv, "chance_small": float(np.mean([c[1] for c in chance]))}


def pooled(selected: list[tuple[np.ndarray, np.ndarray, int]], normalised: bool) -> tuple[float, float, int, int]:
    """(AUC, advantage, members, non-members) over the groups, each group's scores divided by its
    candidates' median distance when ``normalised``."""
    members, others = [], []
    for m, o, _ in selected:
        scale = float(np.median(-np.concatenate([m, o]))) if normalised else 1.0
        members.append(m / max(scale, 1e-12))
        others.append(o / max(scale, 1e-12))
    if not members:
        return float("nan"), float("nan"), 0, 0
    m, o = np.concatenate(members), np.concatenate(others)
    return auc(m, o), advantage(m, o), m.size, o.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "privacy_bench")
    parser.add_argument("--epsilons", nargs="+", default=["inf", "8", "4", "1"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    cache_dir = args.cache_dir or args.out / "cache"
    print("| ε (target) | DP bound on the advantage | members / non-members | AUC, raw | advantage, raw "
          "| AUC, per class | advantage, per class (chance) | small classes: members / non-members | AUC "
          "| advantage (chance) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for epsilon in args.epsilons:
        groups = []
        for seed in args.seeds:
            run_dir = cell_dir(args.out, "fedproto", epsilon, seed)
            if len(read_rows(run_dir)) != args.rounds:
                run_cell(args.out, "fedproto", epsilon, seed, args.rounds, cache_dir)
            groups += run_scores(run_dir)
        s = summarise(groups)
        bound = dp_advantage_bound(float(epsilon), 1e-5)
        print(f"| {'∞' if epsilon == 'inf' else epsilon} | {bound:.3f} | {s['members']} / {s['non_members']} "
              f"| {s['auc_raw']:.3f} | {s['adv_raw']:.3f} | {s['auc_class']:.3f} "
              f"| {s['adv_class']:.3f} ({s['chance_class']:.3f}) | {s['small_members']} / {s['small_non_members']} "
              f"| {s['auc_small']:.3f} | {s['adv_small']:.3f} ({s['chance_small']:.3f}) |",
              flush=True)


if __name__ == "__main__":
    main()
