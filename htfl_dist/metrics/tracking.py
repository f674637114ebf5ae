"""MLflow and Weights & Biases copies of a run, where researchers browse, filter and plot runs
(``output.mlflow``, ``output.wandb``; docs/running.md, "MLflow and Weights & Biases").

One tracking run per run directory: the config flattened into params, the config hash and the
code version as tags, every metrics row at step = its round, and at the end summary.json,
per_client.jsonl, config.yaml and the run's pictures as artifacts. The tracking run's id is kept
in ``RUN/tracking.json`` (written atomically), so ``--resume`` continues the same tracking run
rather than starting a second one. ``metrics.jsonl`` stays the record: these sinks are called
after its row is written, and ``sinks.open_sinks`` wraps them so that their failure costs the
copy and never the run. mlflow and wandb are imported here alone, when a run asks for them.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from htfl_dist.config import Config
from htfl_dist.metrics.report import CONFIG_FILE, PER_CLIENT_FILE, SUMMARY_FILE
from htfl_dist.metrics.sinks import row_numbers
from htfl_dist.metrics.writer import write_json

TRACKING_FILE = "tracking.json"
"""``{"mlflow": {"tracking_uri", "run_id"}, "wandb": {"project", "run_id"}}``: which tracking runs hold
this run directory's rows."""
DEFAULT_EXPERIMENT = "htfl_dist"
"""The MLflow experiment of a run outside a study (``output.tracking_group`` unset)."""
MLFLOW_PARAM_CHARS = 6000
"""MLflow refuses longer param values (its file store's limit); a longer value is cut."""
MLFLOW_BATCH = {"metrics": 1000, "params": 100, "tags": 100}
"""What one ``log_batch`` call may carry (MLflow's limits)."""
OWN_DIRECTORIES = ("mlruns", "wandb", "tensorboard", "checkpoints")
"""Where the trackers and checkpoints keep their own files: no artifacts are taken from there."""


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"data": {"dataset": "fmnist"}}`` as ``{"data.dataset": "fmnist"}``: strings as they are,
    other values as JSON (``null``, ``true``, ``[0, 1]``), the way config.yaml spells them."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


def code_version() -> str:
    """The engine's version and, in a git checkout, its commit (``0.1.0+g1a2b3c4``, ``.dirty``
    with uncommitted changes): what ran, beside the config hash that says what was computed."""
    from htfl_dist import __version__

    try:
        described = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12", "--exclude=*"],
                                   cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return __version__
    commit = described.stdout.strip().replace("-dirty", ".dirty")
    return f"{__version__}+g{commit}" if described.returncode == 0 and commit else __version__


def identity_tags(config: Config) -> dict[str, str]:
    return {"htfl_dist.config_hash": config.config_hash(), "htfl_dist.code_version": code_version()}


def tracking_name(config: Config, out_dir: Path) -> str:
    return config.output.tracking_name or out_dir.name


def tracking_ids(out_dir: Path) -> dict[str, Any]:
    """What ``RUN/tracking.json`` holds ({} when absent or unreadable: a new tracking run then)."""
    try:
        ids = json.loads((out_dir / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def keep_tracking_id(out_dir: Path, backend: str, entry: dict[str, str]) -> None:
    write_json(out_dir / TRACKING_FILE, {**tracking_ids(out_dir), backend: entry})


def resumed_id(out_dir: Path, first_round: int, backend: str, **same: str) -> str | None:
    """The id of the tracking run to continue: on a resume (``first_round`` > 1) the one
    tracking.json names for ``backend``, if it was made with the same ``same`` settings (a run
    moved to another tracking server starts a new one there); a fresh start always starts anew."""
    entry = tracking_ids(out_dir).get(backend)
    if first_round <= 1 or not isinstance(entry, dict):
        return None
    if any(entry.get(key) != value for key, value in same.items()):
        return None
    run_id = entry.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def run_artifacts(out_dir: Path) -> Iterator[tuple[Path, str]]:
    """The finished run's files to keep beside its metrics, with the folder each belongs in
    ('' = top level): summary.json, per_client.jsonl, config.yaml and every picture."""
    for name in (SUMMARY_FILE, PER_CLIENT_FILE, CONFIG_FILE):
        if (out_dir / name).is_file():
            yield out_dir / name, ""
    for picture in sorted(out_dir.rglob("*.png")):
        folder = picture.parent.relative_to(out_dir)
        if not folder.parts or folder.parts[0] not in OWN_DIRECTORIES:
            yield picture, folder.as_posix() if folder.parts else ""


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ------------------------------------------------------------------------------------------ MLflow

def mlflow_tracking_uri(config: Config, out_dir: Path) -> str:
    """``output.mlflow_uri`` as MLflow takes it: a directory (or ``file:`` URI) becomes a file
    store, by default RUN/mlruns. MLflow 3 keeps its file store in maintenance and refuses it
    unless ``MLFLOW_ALLOW_FILE_STORE`` is set; a file store needs no database packages, and
    concurrent cells of a study write into one safely (a directory per run), so it is allowed
    for this process when the store is a directory."""
    uri = config.output.mlflow_uri
    if uri is not None and urlparse(uri).scheme not in ("", "file"):
        return uri  # a server, a database, databricks: as given
    if uri is None:
        path = out_dir / "mlruns"
    else:
        path = Path(urlparse(uri).path if uri.startswith("file:") else uri).expanduser()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return path.resolve().as_uri()


class MlflowSink:
    """One MLflow run per run directory (continued on resume); the experiment is the study's
    title (``output.tracking_group``) or ``htfl_dist``."""

    def __init__(self, config: Config, out_dir: Path, first_round: int) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.out_dir = out_dir
        self.uri = mlflow_tracking_uri(config, out_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        run_id = resumed_id(out_dir, first_round, "mlflow", tracking_uri=self.uri)
        known_params: dict[str, str] = {}
        self.logged_rounds: set[int] = set()
        if run_id is not None and self._exists(run_id):
            self.client.update_run(run_id, status="RUNNING")
            known_params = self.client.get_run(run_id).data.params
            # rounds the earlier attempt logged after its checkpoint are computed again, alike: kept once
            self.logged_rounds = {int(m.step) for m in self.client.get_metric_history(run_id, "test_acc")}
        else:
            experiment = self._experiment(config.output.tracking_group or DEFAULT_EXPERIMENT)
            run_id = self.client.create_run(experiment, run_name=tracking_name(config, out_dir)).info.run_id
            keep_tracking_id(out_dir, "mlflow", {"tracking_uri": self.uri, "run_id": run_id})
        self.run_id = run_id
        self._set_tags({**identity_tags(config), "htfl_dist.run_dir": str(out_dir.resolve()),
                        **({"htfl_dist.group": config.output.tracking_group} if config.output.tracking_group else {})})
        # params cannot change in MLflow: a resume logs the ones not there yet (``rounds`` keeps its first value)
        params = [Param(key, value[:MLFLOW_PARAM_CHARS]) for key, value in flat_params(config.to_dict()).items()
                  if key not in known_params]
        for chunk in _chunks(params, MLFLOW_BATCH["params"]):
            self.client.log_batch(self.run_id, params=chunk)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False  # the store was cleared or moved: a new tracking run
        return True

    def _experiment(self, name: str) -> str:
        """The experiment's id, made if new; a study's cells may race to make it."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except MlflowException:
            found = self.client.get_experiment_by_name(name)  # another cell made it first
            if found is None:
                raise
            return str(found.experiment_id)

    def _set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(key, value) for key, value in tags.items()]
        for chunk in _chunks(entries, MLFLOW_BATCH["tags"]):
            self.client.log_batch(self.run_id, tags=chunk)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Every row not logged yet (a resume's first call also catches up rows an earlier
        attempt could not log), its numbers at step = round."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        new = [row for row in rows if row["round"] not in self.logged_rounds]
        metrics = [Metric(key, value, now, row["round"]) for row in new for key, value in row_numbers(row).items()]
        for chunk in _chunks(metrics, MLFLOW_BATCH["metrics"]):
            self.client.log_batch(self.run_id, metrics=chunk)
        self.logged_rounds.update(row["round"] for row in new)

    def close(self) -> None:
        """A finished run (summary.json written) keeps its files and is marked FINISHED; one that
        stopped early (preempted, failed) is KILLED until a resume continues it."""
        finished = (self.out_dir / SUMMARY_FILE).is_file()
        if finished:
            for path, folder in run_artifacts(self.out_dir):
                self.client.log_artifact(self.run_id, str(path), artifact_path=folder or None)
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


# -------------------------------------------------------------------------------- Weights & Biases

class WandbSink:
    """One W&B run per run directory, offline by default (``output.wandb_mode``): the files go to
    RUN/wandb/ and leave the machine only with ``wandb sync``. A resume logs under the same run id
    (a new offline folder, which ``wandb sync`` appends to the same run)."""

    def __init__(self, config: Config, out_dir: Path, first_round: int) -> None:
        import wandb

        self.out_dir = out_dir
        self.first_round = first_round
        project = config.output.wandb_project
        run_id = resumed_id(out_dir, first_round, "wandb", project=project)  # None: W&B makes one
        tags = identity_tags(config)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False,
                                  x_save_requirements=False, disable_job_creation=True)
        self.run = wandb.init(project=project, group=config.output.tracking_group,
                              name=tracking_name(config, out_dir), id=run_id, resume="allow",
                              mode=config.output.wandb_mode, dir=str(out_dir),
                              config={**config.to_dict(), "htfl_dist": {key.split(".")[-1]: value
                                                                         for key, value in tags.items()}},
                              tags=[f"{key.split('.')[-1]}={value}"[:64] for key, value in tags.items()],
                              settings=settings)
        keep_tracking_id(out_dir, "wandb", {"project": project, "run_id": self.run.id})
        self.written_round = first_round - 1  # earlier rounds are in the earlier attempt's files

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["round"] > self.written_round:
                self.run.log(row_numbers(row), step=row["round"])
                self.written_round = row["round"]

    def close(self) -> None:
        """A finished run gets its summary's numbers and files; one that stopped early is marked
        preempting, for the resume to continue."""
        summary_file = self.out_dir / SUMMARY_FILE
        if summary_file.is_file():
            summary = json.loads(summary_file.read_text())
            self.run.summary.update({key: value for key, value in summary.items()
                                     if isinstance(value, int | float) and not isinstance(value, bool)})
            for path, _ in run_artifacts(self.out_dir):
                self.run.save(str(path), base_path=str(self.out_dir), policy="now")
            self.run.finish()
        else:
            self.run.mark_preempting()
            self.run.finish(exit_code=1)
