"""Optional copies of the metrics rows where ML users look for them: TensorBoard event files,
HtFLlib's ``.h5`` result arrays, MLflow and Weights & Biases runs (``metrics.tracking``).
``metrics.jsonl`` stays the record; these are views of it, written by rank 0 after each
evaluated round (``output.tensorboard``, ``output.htfllib_h5``, ``output.mlflow``, ``output.wandb``).
A copy that fails (a full disk, an unreachable server) says so in one line and stops; the run and
its metrics.jsonl go on (``GuardedSink``).
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
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


def row_numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric values by key, ``round`` aside (booleans, lists and missing values are
    left out): what the trackers log at step = round, under the row's own names."""
    return {key: float(value) for key, value in row.items()
            if key not in NOT_SCALARS and not isinstance(value, bool) and isinstance(value, (int, float))}


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric values by TensorBoard tag."""
    return {scalar_tag(key): value for key, value in row_numbers(row).items()}


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


TRACKERS = {"mlflow": "mlflow-skinny", "wandb": "wandb"}
"""``output.<key>``: the package that provides it (the extra ``.[<key>]`` installs it)."""


def check_outputs_available(config: Config) -> None:
    """Called on every rank before any communication, so a missing package is one line and
    exit 2 rather than a failure of rank 0 alone after the others started. The trackers are
    looked up, not imported (an import of either takes seconds, and only rank 0 uses them)."""
    if config.output.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("output.tensorboard=true needs the tensorboard package: "
                              "pip install -e .[tensorboard] (or pip install tensorboard)") from None
    for key, package in TRACKERS.items():
        if getattr(config.output, key) and not _installed(key):
            raise ConfigError(f"output.{key}=true needs the {package} package: "
                              f"pip install -e .[{key}] (or pip install {package})")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a module without a spec
        return False


class GuardedSink:
    """A sink whose failure costs its copy and nothing else: the first exception it raises (a full
    disk, an unreachable server, the library's own error) is one warning line naming the sink,
    the round and the reason, and the sink is left out for the rest of the run. metrics.jsonl
    has the row already; a resume's sink catches up where it can (MLflow)."""

    def __init__(self, name: str, sink: MetricsSink) -> None:
        self.name = name
        self.sink: MetricsSink | None = sink

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.sink is not None:
            try:
                self.sink.write(rows)
            except Exception as exc:  # any failure of a copy leaves the run going
                self.sink = None
                warn_sink_failed(self.name, f"at round {rows[-1]['round']}", exc)

    def close(self) -> None:
        if self.sink is not None:
            sink, self.sink = self.sink, None
            try:
                sink.close()
            except Exception as exc:
                warn_sink_failed(self.name, "at the end of the run", exc)


def warn_sink_failed(name: str, when: str, exc: BaseException) -> None:
    reason = (str(exc).strip().splitlines() or [""])[0][:300]
    print(f"htfl_dist: warning: the {name} copy of the metrics stopped {when} ({type(exc).__name__}"
          f"{': ' + reason if reason else ''}); metrics.jsonl keeps every row and the run goes on without it",
          file=sys.stderr, flush=True)


def _opened(name: str, opener: Callable[[], MetricsSink]) -> GuardedSink | None:
    """The sink ``opener`` makes, guarded; None (after the warning line) when opening fails."""
    try:
        return GuardedSink(name, opener())
    except Exception as exc:
        warn_sink_failed(name, "as the run began", exc)
        return None


def open_sinks(config: Config, out_dir: Path, first_round: int) -> list[MetricsSink]:
    """The sinks the config asks for, each guarded; ``first_round`` is the first round this
    process will run (above 1: a resume, which continues the tracking runs it finds)."""
    from htfl_dist.metrics import tracking

    openers: list[tuple[bool, str, Callable[[], MetricsSink]]] = [
        (config.output.tensorboard, "tensorboard", lambda: TensorBoardSink(out_dir / "tensorboard", first_round)),
        (config.output.htfllib_h5, "htfllib_h5", lambda: HtfllibH5Sink(out_dir / htfllib_h5_name(config))),
        (config.output.mlflow, "mlflow", lambda: tracking.MlflowSink(config, out_dir, first_round)),
        (config.output.wandb, "wandb", lambda: tracking.WandbSink(config, out_dir, first_round)),
    ]
    opened = [_opened(name, opener) for wanted, name, opener in openers if wanted]
    return [sink for sink in opened if sink is not None]
