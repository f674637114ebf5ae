"""pfl's side of the comparison (bench/pfl_side_by_side.py), run with the python of pfl's own venv
(bench/pfl_setup.sh), never with htfl_dist's: pfl's public API only, set up as its CIFAR-10
benchmark sets itself up (apple/pfl-research c9d1f32f6e84,
``benchmarks/image_classification/pytorch/train.py`` with ``configs/baseline.yaml``):
``PyTorchModel`` with local ``torch.optim.SGD`` and a central ``SGD(lr=1.0)``, ``WeightByUser``,
``SimulatedBackend``, ``FederatedAveraging``, ``NNTrainHyperParams(local lr, 1 epoch, batch)``,
users made as its ``cifar10_iid`` makes them (a permutation, then consecutive slices of
``--samples``) from the pictures bench/pfl_data.py draws, on pfl's ``random`` user sampler.
Left out of the timed loop: central evaluation and metrics files (the benchmark evaluates every
10 iterations). pfl evaluates the cohort before and after training on iteration 0 whatever the
evaluation frequency, so the first round is a warm-up round.

Several workers: ``python -m torch.distributed.run --nproc_per_node=W bench/pfl_runner.py ...``;
pfl finds torchrun's variables, joins a gloo group and gives worker w the cohort's users i with
i mod W = w, then all-reduces one sum per worker.

Writes ``--result`` (rank 0) / ``--result.rankR``: round seconds (between the ends of consecutive
central iterations, the first from the start of training) and the SGD steps each round took there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import pfl_data
import pfl_gate
import pfl_probe
import torch
from pfl_cnn import HIDDEN, pfl_cnn_layers

pfl_probe.install()

from pfl.aggregate.simulate import SimulatedBackend  # noqa: E402  (after the probe: it hooks every step)
from pfl.aggregate.weighting import WeightByUser  # noqa: E402
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams  # noqa: E402
from pfl.callback.base import TrainingProcessCallback  # noqa: E402
from pfl.data.federated_dataset import FederatedDataset  # noqa: E402
from pfl.data.sampling import get_user_sampler  # noqa: E402
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams  # noqa: E402
from pfl.internal.ops.pytorch_ops import get_default_device  # noqa: E402
from pfl.metrics import Metrics, Weighted  # noqa: E402
from pfl.model.pytorch import PyTorchModel  # noqa: E402


class PflCNN(torch.nn.Module):
    """The benchmark CNN with the ``loss`` and ``metrics`` methods ``PyTorchModel`` requires
    (batch-mean cross-entropy, as the benchmark's ``image_classification_loss``)."""

    def __init__(self, nhwc: bool) -> None:
        super().__init__()
        self.nhwc = nhwc
        self.features, self.head = pfl_cnn_layers(in_channels=pfl_data.SHAPE[0], image_size=pfl_data.SHAPE[1],
                                                  hidden=HIDDEN, num_classes=pfl_data.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nhwc:  # pfl's Transpose2D: its pictures are stored NHWC
            x = x.permute(0, 3, 1, 2)
        return self.head(self.features(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(x), y.long())

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Weighted]:
        self.eval() if eval else self.train()
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y.long(), reduction="sum").item()
        correct = (logits.argmax(-1) == y.long()).float().sum().item()
        return {"loss": Weighted(loss, len(x)), "accuracy": Weighted(correct, len(x))}


class RoundClock(TrainingProcessCallback):
    """Wall time and local SGD steps of each central iteration, on this worker. Under the bench's
    ``--lockstep`` (bench/pfl_gate.py) it also holds each iteration until the driver's go, and
    starts the iteration's clock only then: the wait is in no round's seconds. With several
    workers rank 0 alone talks to the gate, and after its go every worker meets at a barrier of
    the process group pfl joined (``torch.distributed``, gloo, set up when pfl is imported under
    torchrun), so no worker starts the next iteration before the driver lets the side go."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.last = 0.0
        self.steps_before = 0
        self.seconds: list[float] = []
        self.steps: list[int] = []

    def on_train_begin(self, *, model) -> Metrics:
        self._hold(0)
        self.last, self.steps_before = time.perf_counter(), pfl_probe.steps()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        if torch.cuda.is_available():  # the iteration's kernels finished, not just queued
            torch.cuda.synchronize()
        now, steps = time.perf_counter(), pfl_probe.steps()
        self.seconds.append(now - self.last)
        self.steps.append(steps - self.steps_before)
        pfl_gate.done(central_iteration)
        if central_iteration + 1 < self.rounds:  # pfl asks no further iteration after the last
            self._hold(central_iteration + 1)
        self.last, self.steps_before = (time.perf_counter() if pfl_gate.active() else now), steps
        return False, Metrics()

    @staticmethod
    def _hold(round_index: int) -> None:
        """Until the driver's go for round ``round_index`` (rank 0's gate), then every worker meets."""
        pfl_gate.ready(round_index)
        if pfl_gate.active() and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()


def federated_data(clients: int, samples: int, seed: int, nhwc: bool) -> FederatedDataset:
    """``clients`` users of ``samples`` pictures each, cut from one permutation of the pooled
    pictures as pfl's ``make_iid_federated_dataset`` cuts CIFAR-10 (the same pool as our run's:
    ``samples`` + 1 per class and client, of which our run trains on ``samples``)."""
    per_client = pfl_data.CLASSES * (samples // pfl_data.CLASSES + 1)
    labels = pfl_data.balanced_labels(clients * per_client // pfl_data.CLASSES)
    images = pfl_data.normalised(pfl_data.draw_images(labels, seed))
    if nhwc:
        images = np.ascontiguousarray(images.transpose(0, 2, 3, 1))
    order = np.random.permutation(len(labels))[:clients * samples]
    x, y = torch.from_numpy(images[order]), torch.from_numpy(labels[order])
    users = {user: (x[user * samples:(user + 1) * samples], y[user * samples:(user + 1) * samples])
             for user in range(clients)}
    return FederatedDataset.from_slices(users, get_user_sampler("random", list(range(clients))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("clients", 1000), ("per-round", 50), ("samples", 50), ("rounds", 5), ("batch", 10),
                          ("seed", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.1, help="local SGD rate (baseline.yaml local_learning_rate)")
    parser.add_argument("--central-lr", type=float, default=1.0, help="baseline.yaml learning_rate")
    parser.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw",
                        help="nhwc: pictures stored NHWC and transposed by the model, as pfl's benchmark does")
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.random.manual_seed(args.seed)  # as the benchmark's train.py seeds
    np.random.seed(args.seed)
    nhwc = args.layout == "nhwc"
    data = federated_data(args.clients, args.samples, args.seed, nhwc)
    network = PflCNN(nhwc).to(get_default_device())
    central = torch.optim.SGD([p for p in network.parameters() if p.requires_grad], args.central_lr)
    pfl_probe.exclude(central)  # the central step applies the average; it is no local SGD step
    model = PyTorchModel(model=network, local_optimizer_create=torch.optim.SGD, central_optimizer=central)
    backend = SimulatedBackend(training_data=data, val_data=None, postprocessors=[WeightByUser()])
    clock = RoundClock(args.rounds)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=args.rounds + 1,
                                           train_cohort_size=args.per_round, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.lr, local_num_epochs=1,
                                              local_batch_size=args.batch),
        model_eval_params=NNEvalHyperParams(local_batch_size=args.batch), callbacks=[clock])
    rank = int(os.environ.get("RANK", "0"))
    path = args.result if rank == 0 else f"{args.result}.rank{rank}"
    with open(path, "w") as handle:
        json.dump({"round_seconds": clock.seconds, "round_steps": clock.steps, "rank": rank}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
