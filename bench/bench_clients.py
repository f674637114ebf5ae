"""What several benchmarks share: a config's clients built as the runtime builds them, and the
client half of its algorithm, outside the round loop (so a benchmark can time one client's epoch);
and the real program run as a user runs it, one process or torchrun, with its metrics rows.

Benchmarks run as scripts (``python bench/NAME.py``), so this directory is on ``sys.path`` and
they import this module as ``bench_clients``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from htfl_dist.algorithms import AlgorithmContext, ClientAlgorithm, ClientState, get_algorithm, parse_options
from htfl_dist.config import Config
from htfl_dist.data import PartitionInfo, load_client_split
from htfl_dist.metrics.writer import read_rows
from htfl_dist.models import architecture_for_client, initial_client_model
from htfl_dist.seeding import seed_global_torch


def client_algorithm(config: Config, info: PartitionInfo, device: torch.device
                     ) -> tuple[ClientAlgorithm, dict[str, torch.Tensor]]:
    """The config's client algorithm and an empty download (no knowledge yet, as in round 1)."""
    entry = get_algorithm(config.algorithm)
    context = AlgorithmContext(num_classes=info.num_classes, feature_dim=config.model.feature_dim, seed=config.seed,
                               train=config.train, options=parse_options(entry, config.algo), device=device,
                               num_clients=config.num_clients, model_group=config.model.group,
                               in_channels=info.in_channels, image_size=info.image_size)
    empty = {field.name: torch.empty((0, *field.trailing_shape), dtype=field.dtype, device=device)
             for field in entry.server.download_fields(context)}
    return entry.client(context), empty


def build_client(config: Config, info: PartitionInfo, client_id: int, device: torch.device,
                 algorithm: ClientAlgorithm | None = None) -> ClientState:
    """Client ``client_id`` with its initial model (as the config initialises it), plain SGD and its
    split on ``device``; ``algorithm`` given: its ``init_client`` too."""
    split = load_client_split(info.path, client_id)
    model = initial_client_model(config.model.group, client_id, config.seed, num_classes=info.num_classes,
                                 feature_dim=config.model.feature_dim, in_channels=info.in_channels,
                                 image_size=info.image_size, init=config.model.init).to(device)
    client = ClientState(client_id, architecture_for_client(config.model.group, client_id), model,
                         torch.optim.SGD(model.parameters(), lr=config.train.lr), split.train_x.to(device),
                         split.train_y.to(device), split.test_x.to(device), split.test_y.to(device), device)
    if algorithm is not None:
        seed_global_torch(config.seed, "algorithm-init", client_id)  # as the runtime does
        algorithm.init_client(client)
    return client


REPO = Path(__file__).resolve().parents[1]


def run_program(config: str | Path, out: Path, overrides: list[str], nproc: int = 1) -> list[dict[str, Any]]:
    """``python -m htfl_dist.main`` (``nproc`` > 1: under ``torchrun --standalone``) with one
    thread per process; exits naming the command if the run fails; its metrics rows."""
    program = ["-m", "htfl_dist.main", "--config", str(config), "--out", str(out), "runtime.threads=1", *overrides]
    if nproc == 1:
        command = [sys.executable, *program]
    else:
        command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
                   *program]
    result = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                            text=True)
    if result.returncode != 0:
        sys.exit(f"bench: run failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    return read_rows(out / "metrics.jsonl")
