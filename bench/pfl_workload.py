"""pfl-research's CIFAR-10 benchmark workload as an htfl_dist plugin, written the way a user
writes one (docs/plugins.md, examples/htfl_example_plugin/), for bench/pfl_side_by_side.py.

What was read, and from where (apple/pfl-research, commit c9d1f32f6e84, the newest snapshot
fetched; the benchmark itself is unchanged in pfl 0.6.0's release):
- ``benchmarks/model/pytorch/cnn.py`` ``simple_cnn``: 2 conv + 2 dense layers (bench/pfl_cnn.py
  lists them); its loss is the batch-mean cross-entropy (``benchmarks/model/pytorch/metrics.py``).
- ``benchmarks/image_classification/configs/baseline.yaml``: ``cifar10_iid``, 50 samples a user
  (constant), cohort 50, one local epoch, local batch 10, local SGD at 0.1, central SGD at 1.0 on
  the averaged model difference (= the plain average of the cohort's models), FedAvg,
  ``weight_by_samples: false`` (every user weighs the same).
Nothing of pfl's code is here: bench/pfl_cnn.py is our own module of the same shape.

Registers
- ``pfl_cnn``: that CNN as a ``SplitModel``: the feature extractor ends after the second
  dropout (K = ``model.feature_dim``, 128 in pfl's model), the head is the last Linear(K, C);
- ``pfl_cifar_like``: CIFAR-shaped generated pictures (bench/pfl_data.py) read from
  ``ROOT/pfl_cifar_like.npz``, which ``write_dataset`` draws deterministically from a seed;
- ``pfl_fedavg``: FedAvg over the whole model, the engine's model-part block with the part set to
  the whole client model (no built-in algorithm shares the whole model: LG-FedAvg shares the
  head, the example plugin's FedPer the extractor), averaged uniformly (``algo.avg``).

With HTFL_PFL_BENCH_PROBE set, each process counts its SGD steps (bench/pfl_probe.py), and with
HTFL_PFL_BENCH_DUMP set the server saves the global model row after each round
(``global-round-R.pt``), which the bench compares with the bare loop's; with
HTFL_PFL_BENCH_GATE set (the bench's ``--lockstep``), rank 0 waits for the bench's go before it
sends each round's knowledge (``LockstepRounds``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pfl_data
import pfl_gate
import pfl_probe
import torch
from pfl_cnn import pfl_cnn_layers

from htfl_dist.api import (
    WHOLE_MODEL,
    Average,
    ClientState,
    ConfigError,
    DataError,
    DatasetArrays,
    DatasetSource,
    PartAveragingServer,
    PartSharingClient,
    Payload,
    SplitModel,
    TrainResult,
    register_algorithm,
    register_architecture,
    register_dataset,
    replaced_atomically,
)

DATASET = "pfl_cifar_like"
FILE_NAME = f"{DATASET}.npz"
DUMP_ENV = "HTFL_PFL_BENCH_DUMP"

if pfl_probe.install():
    pfl_probe.gate()  # count the clients' local steps alone (PflFedAvgClient.train)


# --------------------------------------------------------------------------- the model


@register_architecture("pfl_cnn")
def build_pfl_cnn(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
    """pfl's CIFAR-10 benchmark CNN (2 conv + 2 dense, bench/pfl_cnn.py), split before its last
    layer: K = ``model.feature_dim`` is its dense width (128 in pfl's)."""
    try:
        extractor, head = pfl_cnn_layers(in_channels=in_channels, image_size=image_size, hidden=feature_dim,
                                         num_classes=num_classes)
    except ValueError as exc:
        raise ConfigError(f"model pfl_cnn: {exc}") from None
    return SplitModel(extractor, head, feature_dim, arch="pfl_cnn")


# --------------------------------------------------------------------------- the data


def _file(root: str | None) -> str:
    if not root:
        raise DataError(f"dataset {DATASET} needs data.root=DIR holding {FILE_NAME} "
                        f"(pfl_workload.write_dataset(DIR, ...) draws one)")
    path = os.path.join(root, FILE_NAME)
    if not os.path.isfile(path):
        raise DataError(f"dataset {DATASET}: no {path}; draw one with pfl_workload.write_dataset")
    return path


def load_pfl_cifar_like(root: str | None) -> DatasetArrays:
    with np.load(_file(root), allow_pickle=False) as data:
        images, labels = data["images"], data["labels"].astype(np.int64)
    if images.dtype != np.uint8 or images.shape[1:] != pfl_data.SHAPE or labels.shape != images.shape[:1]:
        raise DataError(f"dataset {DATASET}: {FILE_NAME} must hold uint8 images N x 3 x 32 x 32 and N labels")
    return DatasetArrays(images=images, labels=labels, num_classes=pfl_data.CLASSES, name=DATASET)


register_dataset(DatasetSource(name=DATASET, num_classes=pfl_data.CLASSES, files=lambda root: [_file(root)],
                               load=load_pfl_cifar_like))


def write_dataset(root: str | os.PathLike, per_class: int, seed: int) -> Path:
    """``root/pfl_cifar_like.npz``: ``per_class`` pictures of each of the 10 classes, drawn from
    ``seed``; an existing file is kept (its mtime is in the partition cache's key, so rewriting it
    would rebuild the cache), so ``root`` should name the size and the seed."""
    path = Path(root) / FILE_NAME
    if not path.is_file():
        labels = pfl_data.balanced_labels(per_class)
        images = pfl_data.draw_images(labels, seed)
        with replaced_atomically(path, images.nbytes + labels.nbytes) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, images=images, labels=labels)
    return path


# --------------------------------------------------------------------------- the algorithm


@dataclass
class PflFedAvgOptions:
    avg: Average = "uniform"
    """Server mean of the uploaded models: uniform (pfl's benchmark, ``weight_by_samples: false``)
    | sample_weighted (n_i / Σn, McMahan et al.'s FedAvg)."""


class LockstepRounds:
    """The bench's ``--lockstep`` gate (bench/pfl_gate.py) where rank 0 is about to send the
    clients their knowledge: the server's ``download``, which the engine's loop calls once a
    round on rank 0 alone, before the broadcast (the round's start, or, as the bench evaluates
    every round, the evaluation that ends the round before: the next round trains on that
    knowledge). The engine's round observers would be the natural place, but the plugin API
    (htfl_dist.api, docs/plugins.md) declares no way to add one, so the gate sits in the
    algorithm, which the API does declare. Holding rank 0 before the broadcast holds every rank:
    the others wait for it (with one process it is the same point). The round is the server's
    updates so far: the knowledge for round R is downloaded after R updates, so another download
    in between (an observer's snapshot) is the same round and passes. Round R's "done" is said
    at the next download (the last round's by the process's exit, ``pfl_gate.ready`` passing a
    round past the last): the driver's go-to-done time is one whole turn of the engine's loop,
    from one broadcast to the next (round R-1's evaluation of one client, its record and close,
    round R's selection, training, upload and average), as pfl's clock, which runs from one
    iteration's end to the next."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.updates = 0

    def downloading(self) -> None:
        """Rank 0 is about to broadcast the knowledge for round ``self.updates``."""
        if not pfl_gate.active() or self.updates == self.current:
            return
        if self.current is not None:
            pfl_gate.done(self.current)
        pfl_gate.ready(self.updates)
        self.current = self.updates

    def updated(self) -> None:
        """The server's step of a round is done: the next download is the next round's."""
        self.updates += 1


_LOCKSTEP = LockstepRounds()


class PflFedAvgClient(PartSharingClient):
    part = WHOLE_MODEL
    algorithm_name = "pfl_fedavg"

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        """The block's local training; the steps it takes are what the bench's probe counts."""
        with pfl_probe.counting():
            return super().train(client, knowledge, round_index, generator)


class PflFedAvgServer(PartAveragingServer):
    part = WHOLE_MODEL
    average_option = "avg"

    def download(self) -> Payload:
        """The block's download; under the bench's ``--lockstep`` it first waits at the gate."""
        _LOCKSTEP.downloading()
        return super().download()

    def update(self, uploads: dict[int, Any], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        """The block's average; with HTFL_PFL_BENCH_DUMP set, the new global row saved as well."""
        metrics = super().update(uploads, round_index, generator)
        _LOCKSTEP.updated()
        self._dump(round_index)
        return metrics

    def update_from_sums(self, sums: dict[str, torch.Tensor], uploaders: int, round_index: int,
                         generator: torch.Generator) -> dict[str, Any]:
        """The same from the round's sum (``runtime.presum_uploads``): defined beside ``update``, so
        the registry keeps this server sums-only."""
        metrics = super().update_from_sums(sums, uploaders, round_index, generator)
        _LOCKSTEP.updated()
        self._dump(round_index)
        return metrics

    def _dump(self, round_index: int) -> None:
        directory = os.environ.get(DUMP_ENV)
        if directory:
            with replaced_atomically(Path(directory) / f"global-round-{round_index + 1}.pt") as tmp:
                torch.save(self.row.clone(), tmp)


register_algorithm("pfl_fedavg", server=PflFedAvgServer, client=PflFedAvgClient, options=PflFedAvgOptions,
                   summary="FedAvg over the whole model, uniform mean (pfl's CIFAR-10 benchmark; bench plugin)",
                   shares_parameters=True)
