"""Optional copies of the metrics rows where ML users look for them: TensorBoard event files
and HtFLlib's ``.h5`` result arrays. ``metrics.jsonl`` stays the record; these are views of it,
written by rank 0 after each evaluated round (``output.tensorboard``, ``output.htfllib_h5``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from htfl_dist.atomic import replaced_atomically
from htfl_dist.config import Config
from htfl_dist.errors import ConfigError

NOT_SCALARS = ("round", "skipped_clients")

SCALAR_GROUPS = {
    "accuracy": ("test_acc", "test_acc_head", "test_acc_std"),
    "loss": ("train_loss",),
    "bytes": ("bytes_up", "bytes_down", "bytes_theory_up", "bytes_theory_down", "bytes_setup_up"),
    "time": ("seconds", "client_s", "server_s", "comm_s"),
}
"""TensorBoard tag prefixes; every other numeric key of a row is an algorithm diagnostic."""


class MetricsSink(Protocol):
    def write(self, rows: list[dict[str, Any]]) -> None:
        """Called after each evaluated round with every row so far (the newest last)."""

    def close(self) -> None: ...


def scalar_tag(key: str) -> str:
    """``accuracy/test_acc``, ``time/server_s``, ``algorithm/margin``, ..."""
    for group, keys in SCALAR_GROUPS.items():
        if key in keys:
            return f"{group}/{key}"
    return f"algorithm/{key}"


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric values by tag (booleans, lists and missing values are left out)."""
    scalars = {}
    for key, value in row.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        scalars[scalar_tag(key)] = float(value)
    return scalars


class TensorBoardSink:
    """Scalars per evaluated round, the round number as the step. A resumed run purges the events
    after its checkpoint, so the curves show each round once."""

    def __init__(self, directory: Path, first_round: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("output.tensorboard=true needs the tensorboard package: "
                              "pip install -e .[tensorboard] (or pip install tensorboard)") from None
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=first_round)
        self.written_round = first_round - 1  # earlier rounds are in the event files already

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["round"] <= self.written_round:
                continue
            for tag, value in row_scalars(row).items():
                self.writer.add_scalar(tag, value, global_step=row["round"])
            self.written_round = row["round"]
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class HtfllibH5Sink:
    """HtFLlib's result file: ``rs_test_acc`` and ``rs_train_loss`` as float arrays, one entry per
    evaluated round, plus ``rs_round`` (our addition: which round each entry is). HtFLlib also
    evaluates before round 1 and stores ``rs_test_auc``; we have neither, so those are absent
    rather than invented. The whole file is rewritten atomically, never half-written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, rows: list[dict[str, Any]]) -> None:
        import h5py

        arrays = {
            "rs_round": np.array([row["round"] for row in rows], dtype=np.int64),
            "rs_test_acc": np.array([row["test_acc"] for row in rows], dtype=np.float64),
            "rs_train_loss": np.array([np.nan if row.get("train_loss") is None else row["train_loss"]
                                       for row in rows], dtype=np.float64),
            "rs_test_auc": np.array([np.nan if row.get("test_auc") is None else row["test_auc"]
                                     for row in rows], dtype=np.float64),
        }
        with replaced_atomically(self.path) as tmp, h5py.File(tmp, "w") as handle:
            for name, values in arrays.items():
                handle.create_dataset(name, data=values)

    def close(self) -> None:
        pass


def htfllib_h5_name(config: Config) -> str:
    """``<dataset>_<algorithm>_test_<seed>.h5``: HtFLlib's ``{dataset}_{algorithm}_{goal}_{times}``
    with goal ``test`` and the seed as the repetition index."""
    return f"{config.data.dataset}_{config.algorithm}_test_{config.seed}.h5"


def check_outputs_available(config: Config) -> None:
    """Called on every rank before any communication, so a missing package is one line and
    exit 2 rather than a failure of rank 0 alone after the others started."""
    if config.output.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("output.tensorboard=true needs the tensorboard package: "
                              "pip install -e .[tensorboard] (or pip install tensorboard)") from None


def open_sinks(config: Config, out_dir: Path, first_round: int) -> list[MetricsSink]:
    """The sinks the config asks for; ``first_round`` is the first round this process will run."""
    sinks: list[MetricsSink] = []
    if config.output.tensorboard:
        sinks.append(TensorBoardSink(out_dir / "tensorboard", first_round))
    if config.output.htfllib_h5:
        sinks.append(HtfllibH5Sink(out_dir / htfllib_h5_name(config)))
    return sinks
