"""The floor of the pfl comparison (bench/pfl_side_by_side.py): a bare PyTorch loop doing exactly
the SGD steps of our run, with nothing around them. Each round: for each sampled client, load the
global weights, train one local epoch in batches, add the trained weights to a running sum; the
new global model is the sum over the cohort. Run with the engine's venv:

    python bench/pfl_bare.py --config WORK/ours.yaml --result bare.json [--dump DIR]

It reads the same config as our run and takes from htfl_dist only what fixes the numbers, all
before the timed rounds: the clients' training splits (the partition cache), the sampled clients
of each round, the initial global model (client 0's, as the model-part server starts) and the seed
of each client's dropout draws. So with the same config its global model after round 1 equals
ours within float tolerance (the bench checks it), and its time is what those steps cost alone.
Under the bench's ``--lockstep`` each round waits for the driver's go first (bench/pfl_gate.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pfl_gate
import pfl_probe
import pfl_workload  # noqa: F401  (registers pfl_cnn and the dataset, as --import does for our run)
import torch
import torch.nn.functional as F

from htfl_dist.algorithms.interface import seed_training
from htfl_dist.config import load_config
from htfl_dist.data import load_client_split, prepare_partition
from htfl_dist.models import initial_client_model
from htfl_dist.runtime.placement import sample_participants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="our run's YAML (bench/pfl_side_by_side.py writes it)")
    parser.add_argument("--result", required=True, help="JSON of round times and steps")
    parser.add_argument("--dump", default="", help="directory for global-round-R.pt (the global row)")
    args = parser.parse_args(argv)
    pfl_probe.install()
    torch.set_num_threads(1)
    config = load_config(args.config)
    train, seed = config.train, config.seed
    device = torch.device(config.runtime.device)  # cpu, or cuda with --device cuda
    info = prepare_partition(config.data, config.num_clients, seed, batch_size=train.batch_size)
    cohorts = [sample_participants(seed, r, config.num_clients, config.join_ratio) for r in range(config.rounds)]
    splits = {cid: load_client_split(info.path, cid) for cid in sorted({c for cohort in cohorts for c in cohort})}
    data = {cid: (split.train_x.to(device), split.train_y.to(device)) for cid, split in splits.items()}
    model = initial_client_model(config.model.group, 0, seed, num_classes=info.num_classes,
                                 feature_dim=config.model.feature_dim, in_channels=3, image_size=32).to(device)
    params = list(model.parameters())
    global_weights = [p.detach().clone() for p in params]
    total = [torch.zeros_like(p) for p in params]
    optimizer = torch.optim.SGD(params, lr=train.lr)  # plain SGD keeps no state between clients
    batch = train.batch_size
    round_seconds, round_steps = [], []
    for round_index, cohort in enumerate(cohorts):
        pfl_gate.ready(round_index)  # --lockstep: wait for the driver's go, outside the round's clock
        began, steps = time.perf_counter(), pfl_probe.steps()
        for tensor in total:
            tensor.zero_()
        model.train()
        for cid in cohort:
            with torch.no_grad():
                for p, g in zip(params, global_weights, strict=True):
                    p.copy_(g)
            seed_training(seed, cid, round_index)  # the client's dropout draws, as our run seeds them
            x, y = data[cid]
            with pfl_probe.counting():  # importing the plugin gated the probe to training steps
                for start in range(0, y.shape[0], batch):
                    if start and y.shape[0] - start == 1:  # train.last_batch=keep: a 1-sample tail is not trained
                        break
                    loss = F.cross_entropy(model(x[start:start + batch]), y[start:start + batch])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
            with torch.no_grad():
                for t, p in zip(total, params, strict=True):
                    t.add_(p)
        with torch.no_grad():
            for g, t in zip(global_weights, total, strict=True):
                torch.div(t, len(cohort), out=g)
        if device.type == "cuda":  # the round's kernels finished, not just queued
            torch.cuda.synchronize()
        round_seconds.append(time.perf_counter() - began)
        round_steps.append(pfl_probe.steps() - steps)
        pfl_gate.done(round_index)  # where the clock stopped: the dump below is outside it in both modes
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            row = torch.cat([g.reshape(-1) for g in global_weights]).reshape(1, -1).cpu()
            torch.save(row, os.path.join(args.dump, f"global-round-{round_index + 1}.pt"))
    with open(args.result, "w") as handle:
        json.dump({"round_seconds": round_seconds, "round_steps": round_steps}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
