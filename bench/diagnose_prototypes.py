"""Why does prototype inference win or lose? Inference rules and feature/prototype geometry
from a finished run's newest checkpoint (FedProto, FedTGP: any algorithm that downloads
``class_ids`` + ``protos``).

    python bench/diagnose_prototypes.py runs/bench/fedtgp-dirichlet-s0-r50-861195 [more runs ...]

For every client's test split, pooled over clients:

- ``global``: nearest global prototype (the algorithm's own rule, = test_acc);
- ``global_own``: nearest global prototype among the classes the client trained on
  (how much the label-skew prior alone would add);
- ``own_centroid``: nearest of the client's own class means in its own feature space
  (is the *global* geometry the problem, or nearest-centroid itself?);
- ``head``: the client's own head (= test_acc_head);
- ``d_own`` / ``d_other``: mean distance of a test feature to its class's global prototype
  and to the nearest other one; ``d_own / d_other`` < 1 means features sit inside their
  class's cell of the prototype Voronoi diagram. ``feature_norm`` and ``proto_norm`` give the
  scales (a regulariser too weak to pull features to prototypes shows as d_own ≫ 0).

The run is rebuilt in this process (world size 1) from its config and checkpoint; nothing in
the run directory is modified.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from htfl_dist.algorithms.class_rows import class_prototypes, euclidean_distances
from htfl_dist.config import load_config
from htfl_dist.errors import HtflError
from htfl_dist.runtime.checkpoint import find_checkpoint
from htfl_dist.runtime.loop import Federation, RunContext, start
from htfl_dist.runtime.transport import LocalTransport

RULES = ("global", "global_own", "own_centroid", "head")
GEOMETRY = ("d_own", "d_other", "feature_norm")


def rebuild(run_dir: Path, scratch: Path) -> tuple[Federation, int]:
    """World-size-1 federation restored from the run's newest checkpoint, and its round."""
    if find_checkpoint(run_dir) is None:
        raise HtflError(f"{run_dir}: no complete checkpoint; run with checkpoint_every > 0")
    config = load_config(run_dir / "config.yaml")
    context = RunContext(config, LocalTransport(), torch.device("cpu"), scratch, resume_from=run_dir)
    federation = start(context)
    return federation, federation.restore()


@torch.no_grad()
def diagnose_client(federation: Federation, client, protos: torch.Tensor, class_ids: torch.Tensor) -> dict:
    """Sums (not means) over the client's test samples, so clients pool by sample count."""
    own_ids, own_centroids = class_prototypes(client, federation.session.context.num_classes)
    model = client.model.eval()
    trained_on = torch.isin(class_ids, own_ids)
    features, logits = model.forward_with_features(client.test_x)
    y = client.test_y
    to_global = euclidean_distances(features, protos)
    own_only = torch.where(trained_on.unsqueeze(0), to_global, torch.full_like(to_global, float("inf")))
    matches = class_ids.unsqueeze(0) == y.unsqueeze(1)  # [n, m]: the sample's own class column
    has_proto = matches.any(dim=1)
    d_own = torch.where(matches, to_global, torch.zeros_like(to_global)).sum(dim=1)
    d_other = torch.where(matches, torch.full_like(to_global, float("inf")), to_global).min(dim=1).values
    return {
        "samples": float(y.numel()),
        "global": float((class_ids[to_global.argmin(dim=1)] == y).sum()),
        "global_own": float((class_ids[own_only.argmin(dim=1)] == y).sum()),
        "own_centroid": float((own_ids[euclidean_distances(features, own_centroids).argmin(dim=1)] == y).sum()),
        "head": float((logits.argmax(dim=1) == y).sum()),
        "d_own": float(d_own[has_proto].sum()),
        "d_other": float(d_other[has_proto].sum()),
        "with_proto": float(has_proto.sum()),
        "feature_norm": float(features.norm(dim=1).sum()),
    }


def diagnose(run_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        federation, completed = rebuild(run_dir, Path(scratch))
        knowledge = federation.knowledge()
        if "protos" not in knowledge or knowledge["class_ids"].numel() == 0:
            raise HtflError(f"{run_dir}: the algorithm downloads no global prototypes")
        protos, class_ids = knowledge["protos"].float(), knowledge["class_ids"]
        totals: dict[str, float] = {}
        for client in federation.session.clients.values():
            for key, value in diagnose_client(federation, client, protos, class_ids).items():
                totals[key] = totals.get(key, 0.0) + value
        result = {"run": run_dir.name, "round": completed}
        result.update({rule: totals[rule] / totals["samples"] for rule in RULES})
        result.update({key: totals[key] / totals["with_proto"] for key in ("d_own", "d_other")})
        result["feature_norm"] = totals["feature_norm"] / totals["samples"]
        result["proto_norm"] = float(protos.norm(dim=1).mean())
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories with checkpoints")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    print("| run | round | " + " | ".join(RULES) + " | d_own | d_other | d_own/d_other | feature norm | proto norm |")
    print("|---|---|" + "---|" * (len(RULES) + 5))
    for run_dir in args.runs:
        try:
            r = diagnose(run_dir.resolve())
        except HtflError as exc:
            print(f"diagnose_prototypes: {exc}", file=sys.stderr)
            return 2
        results.append(r)
        print(f"| {r['run']} | {r['round']} | " + " | ".join(f"{r[rule] * 100:.2f}" for rule in RULES)
              + f" | {r['d_own']:.2f} | {r['d_other']:.2f} | {r['d_own'] / r['d_other']:.3f}"
              f" | {r['feature_norm']:.2f} | {r['proto_norm']:.2f} |", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
