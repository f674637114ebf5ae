"""A study file read into cells: the grid's product × seeds, each an ordinary run of
``python -m htfl_dist.main`` with its config file and ``key=value`` overrides.

Every cell is validated here, in process, exactly as ``main`` loads its config, so a mistake in
any cell ends the study with one line naming the cell and the key before anything starts.
"""
from __future__ import annotations

import dataclasses
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from htfl_dist.errors import ConfigError, HtflError

if TYPE_CHECKING:
    from htfl_dist.runtime.bootstrap import RunDirectoryLock

STUDY_KEYS = ("title", "base", "set", "grid", "seeds", "cells", "paper")
CONFIG_AXIS = "config"
"""A grid axis of config files (each cell's base file); its key part is the file's stem."""
STUDY_RECORD = "study.json"


class StudyError(ConfigError):
    """A mistake in the study file, its cells or its directory: one line, exit status 2."""


@dataclass(frozen=True)
class Cell:
    """One run of the study: ``python -m htfl_dist.main --config CONFIG_FILE OVERRIDES``."""

    key: str  # the grid values joined by '/': one table row; seeds fold into it
    seed: int
    config_file: Path
    overrides: tuple[str, ...]
    config_hash: str = ""
    rounds: int = 0
    explicit_keys: frozenset[str] = frozenset()
    """Dotted keys the study itself sets for this cell (the scheduler leaves those alone)."""
    imports: tuple[str, ...] = ()
    """Plugin modules the study's ``--import`` names, passed on to the cell's program."""
    group: str = ""
    """The study's title: the cell's tracking group (``output.tracking_group``)."""
    tracked: bool = False
    """The cell's config asks for MLflow or W&B (``output.mlflow``, ``output.wandb``): its program
    gets the grouping overrides (:meth:`program_overrides`)."""

    @property
    def name(self) -> str:
        return f"{self.key}-seed{self.seed}"

    def run_dir(self, out: Path) -> Path:
        return out / "cells" / self.name

    def program_overrides(self, out: Path) -> list[str]:
        """The cell's overrides, after what groups its tracking runs with the study's other cells
        (unless the study sets them): the study's title as MLflow experiment and W&B group, the
        cell's name as the tracking run's, and one MLflow store for every cell, DIR/mlruns. All
        ``output.*``: plumbing, so no cell's config hash changes. Cells without a tracker get none."""
        if not self.tracked:
            return list(self.overrides)
        grouping = {"output.tracking_group": self.group, "output.tracking_name": self.name,
                    "output.mlflow_uri": str(out / "mlruns")}
        return [*(override_text(key, value) for key, value in grouping.items()
                  if value and key not in self.explicit_keys), *self.overrides]

    def main_args(self, out: Path) -> list[str]:
        """The arguments of ``python -m htfl_dist.main`` for this cell (``--resume auto``: a rerun
        continues an interrupted cell and starts a new one afresh)."""
        imports = [argument for module in self.imports for argument in ("--import", module)]
        return ["--config", str(self.config_file), "--out", str(self.run_dir(out)), "--resume", "auto",
                *imports, *self.program_overrides(out)]


@dataclass(frozen=True)
class Study:
    path: Path
    title: str
    cells: list[Cell]
    keys: list[str]  # the table's rows, in grid order
    paper: dict[str, float]


def override_text(key: str, value: Any) -> str:
    """``key=value`` that ``main``'s override parser reads back as ``value`` (plain when YAML
    reads the plain text back unchanged, JSON otherwise: JSON is YAML)."""
    if isinstance(value, str) and value == value.strip() and value != "":
        try:
            if yaml.safe_load(value) == value:
                return f"{key}={value}"
        except yaml.YAMLError:
            pass
    return f"{key}={json.dumps(value)}"


def _flatten(mapping: Any, where: str, prefix: str = "") -> dict[str, Any]:
    """``{algo: {tau: 100}}`` and ``{algo.tau: 100}`` alike as dotted keys."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise StudyError(f"study key '{where}' must be a mapping of dotted config keys, got {mapping!r}")
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, where, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _label(axis: str, value: Any) -> str:
    if axis == CONFIG_AXIS:
        return Path(str(value)).stem
    text = override_text("", value)[1:].strip('"')
    return text.replace("/", "_") or "empty"


def _resolve_file(study_dir: Path, text: str, where: str) -> Path:
    """Config paths in a study file are relative to the study file, not to where it is run from."""
    path = Path(text).expanduser()
    path = path if path.is_absolute() else (study_dir / path)
    if not path.is_file():
        raise StudyError(f"study key '{where}': config file {str(path)!r} does not exist "
                         f"(relative paths are relative to the study file)")
    return path.resolve()


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StudyError(f"study file {str(path)!r} does not exist")
    from htfl_dist.config import RefusedYaml, load_yaml

    try:
        loaded = load_yaml(path.read_bytes().decode("utf-8"))  # the config loader: duplicate keys, alias caps
    except RefusedYaml as exc:
        raise StudyError(f"study file {str(path)!r} is refused: {exc}") from None
    except UnicodeDecodeError as exc:
        raise StudyError(f"study file {str(path)!r} is not UTF-8 text (offset {exc.start}); save it as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise StudyError(f"study file {str(path)!r} is not valid YAML"
                         f"{f' at line {mark.line + 1}' if mark else ''}") from None
    if not isinstance(loaded, dict):
        raise StudyError(f"study file {str(path)!r} must hold a mapping with keys {', '.join(STUDY_KEYS)}")
    unknown = sorted(set(loaded) - set(STUDY_KEYS))
    if unknown:
        raise StudyError(f"unknown study key '{unknown[0]}'; allowed: {', '.join(STUDY_KEYS)}")
    if "base" not in loaded and CONFIG_AXIS not in (loaded.get("grid") or {}):
        raise StudyError(f"study file {str(path)!r} needs 'base: CONFIG' (or a grid axis 'config:')")
    return loaded


def _grid(raw: Any) -> dict[str, list[Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise StudyError(f"study key 'grid' must map axes to lists of values, got {raw!r}")
    grid = {}
    for axis, values in raw.items():
        if not isinstance(values, list) or not values:
            raise StudyError(f"study key 'grid.{axis}' must be a non-empty list of values, got {values!r}")
        grid[str(axis)] = values
    return grid


def _seeds(raw: Any) -> list[int]:
    seeds = [0] if raw is None else raw if isinstance(raw, list) else [raw]
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) or len(set(seeds)) < len(
            seeds):
        raise StudyError(f"study key 'seeds' must be a list of distinct integers, got {raw!r}")
    return seeds


def _paper(raw: Any) -> dict[str, float]:
    """Reference numbers by cell key: a number, or text like '97.46 ± 0.01' (the mean is kept)."""
    paper = {}
    for key, value in (raw or {}).items():
        try:
            paper[str(key)] = float(str(value).replace("±", " ").split()[0])
        except (ValueError, IndexError):
            raise StudyError(f"study key 'paper.{key}' must be a number (percent), got {value!r}") from None
    return paper


def _product(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    combos: list[dict[str, Any]] = [{}]
    for axis, values in grid.items():
        combos = [{**combo, axis: value} for combo in combos for value in values]
    return combos


def expand(path: Path, extra: list[str] | None = None, seeds: list[int] | None = None,
           imports: tuple[str, ...] = ()) -> Study:
    """The study's cells in order (grid order, seeds innermost), not yet validated. ``extra``:
    ``key=value`` overrides from the command line (``--set``), applied to every cell after the
    study's own ``set``, grid values and ``cells`` (a reduced run: ``rounds=50 data.subsample=0.05``);
    ``seeds`` replaces the study's seeds; ``imports``: plugin modules every cell imports (the
    study's ``--import``; a config's ``plugins`` key reaches its cells by itself)."""
    from htfl_dist.config import parse_overrides

    path = Path(path).resolve()
    raw = _read_yaml(path)
    grid, seeds = _grid(raw.get("grid")), _seeds(raw.get("seeds") if seeds is None else seeds)
    common = _flatten(raw.get("set"), "set")
    command_line = dict(parse_overrides(extra or []))
    patterns = raw.get("cells") or {}
    if not isinstance(patterns, dict):
        raise StudyError(f"study key 'cells' must map cell keys to overrides, got {patterns!r}")
    per_pattern = {str(p): _flatten(o, f"cells.{p}") for p, o in patterns.items()}
    used_patterns: set[str] = set()
    cells, keys = [], []
    for combo in _product(grid):
        parts = [_label(axis, value) for axis, value in combo.items()]
        key = "/".join(parts) or Path(str(raw.get("base", "base"))).stem
        if key in keys:
            raise StudyError(f"two cells share the key '{key}'; give the grid values distinct names")
        keys.append(key)
        config_file = _base_file(path.parent, raw.get("base"), combo)
        values = {**common, **{axis: value for axis, value in combo.items() if axis != CONFIG_AXIS}}
        for pattern in sorted(per_pattern, key=lambda p: len(p.split("/"))):  # the more specific wins
            if set(pattern.split("/")) <= set(parts):
                values.update(per_pattern[pattern])
                used_patterns.add(pattern)
        values.update(command_line)
        for seed in seeds:
            overrides = tuple(override_text(k, v) for k, v in {**values, "seed": seed}.items())
            cells.append(Cell(key, seed, config_file, overrides, explicit_keys=frozenset(values),
                              imports=tuple(imports)))
    title = str(raw.get("title") or path.stem)
    cells = [dataclasses.replace(cell, group=title) for cell in cells]
    unused = sorted(set(per_pattern) - used_patterns)
    if unused:
        raise StudyError(f"study key 'cells.{unused[0]}' matches no cell; cell keys are: {', '.join(keys)}")
    paper = _paper(raw.get("paper"))
    stray = sorted(set(paper) - set(keys))
    if stray:
        raise StudyError(f"study key 'paper.{stray[0]}' names no cell; cell keys are: {', '.join(keys)}")
    return Study(path, title, cells, keys, paper)


def _base_file(study_dir: Path, base: Any, combo: dict[str, Any]) -> Path:
    """The cell's config file: the ``config`` axis, else ``base`` with ``{axis}`` filled in
    (``../configs/fmnist_htcnn8_{algorithm}_{data.partition}.yaml``)."""
    if CONFIG_AXIS in combo:
        return _resolve_file(study_dir, str(combo[CONFIG_AXIS]), "grid.config")
    text = str(base)
    names = [name for _, name, _, _ in string.Formatter().parse(text) if name]
    missing = [name for name in names if name not in combo]
    if missing:
        raise StudyError(f"study key 'base': '{{{missing[0]}}}' is no grid axis; axes: {', '.join(combo) or 'none'}")
    for name in names:
        text = text.replace(f"{{{name}}}", _label(name, combo[name]))
    return _resolve_file(study_dir, text, "base")


def validate(study: Study, ranks_per_cell: int = 1) -> Study:
    """Load every cell's config as ``python -m htfl_dist.main`` does (and make its start-up
    checks), filling in each cell's config hash and planned rounds; the first mistake is one line
    naming the cell."""
    from htfl_dist.runtime.session import checked_config

    checked = []
    for cell in study.cells:
        try:
            config = checked_config(str(cell.config_file), list(cell.overrides), cell.imports, ranks_per_cell)
        except HtflError as exc:
            raise StudyError(f"cell {cell.name}: {exc}") from None
        checked.append(dataclasses.replace(cell, config_hash=config.config_hash(), rounds=config.rounds,
                                           tracked=config.output.mlflow or config.output.wandb))
    return Study(study.path, study.title, checked, study.keys, study.paper)


def check_directory(out: Path, study: Study) -> dict[str, str]:
    """Refuse a DIR that holds another study's cells (writes nothing); returns the cells DIR/study.json
    records (name: config hash).

    A cell name recorded with another config hash, or a recorded cell this study lacks, means the
    directory belongs to another study (more seeds or cells may be added; rounds may grow: they are
    not part of the hash). A non-empty directory without the record is refused too (a lock file
    alone, left by a study killed as it began, does not count)."""
    from htfl_dist.metrics.report import read_summary
    from htfl_dist.runtime.bootstrap import LOCK_FILE

    record_file = out / STUDY_RECORD
    ours = {cell.name: cell.config_hash for cell in study.cells}
    recorded: dict[str, str] = {}
    if record_file.is_file():
        try:
            recorded = json.loads(record_file.read_text())["cells"]
        except (ValueError, KeyError, TypeError):
            raise StudyError(f"{record_file} is damaged; pass a new --out") from None
    elif out.is_dir() and any(entry.name != LOCK_FILE for entry in out.iterdir()):
        raise StudyError(f"--out {out} is not empty and holds no {STUDY_RECORD}: not a study directory; "
                         f"pass a new --out")
    for name, config_hash in recorded.items():
        if ours.get(name) != config_hash:
            why = "this study has no such cell" if name not in ours else \
                f"config hash {config_hash} there, {ours[name]} in this study"
            raise StudyError(f"--out {out} holds cells of another study (cell {name}: {why}); pass a new --out")
    for cell in study.cells:
        summary = read_summary(cell.run_dir(out)) if cell.run_dir(out).is_dir() else None
        if summary is not None and summary.get("config_hash") != cell.config_hash:
            raise StudyError(f"--out {out} holds cells of another study (cell {cell.name}: config hash "
                             f"{summary.get('config_hash')} there, {cell.config_hash} in this study); pass a new --out")
    return recorded


def lock_directory(out: Path) -> RunDirectoryLock:
    """Take DIR for this study's life with the run directory's lock (``DIR/.htfl_dist.lock``, the
    kernel's ``fcntl`` lock: a killed study's lock never blocks the next), or refuse in one line
    naming the study that holds it, before anything is written. The holder's record is written by
    the caller once the directory is claimed."""
    from htfl_dist.runtime.bootstrap import lock_run_directory

    try:
        out.mkdir(parents=True, exist_ok=True)
        return lock_run_directory(out, what="study")
    except OSError as exc:
        raise StudyError(f"cannot write the study directory {out} ({exc.strerror}); pass --out DIR you can "
                         f"write to") from None


def claim_directory(out: Path, study: Study) -> None:
    """Refuse a DIR that holds another study's cells (:func:`check_directory`); record this study's
    cells in DIR/study.json. Under the study's lock (:func:`lock_directory`)."""
    from htfl_dist.metrics.writer import write_json

    recorded = check_directory(out, study)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / STUDY_RECORD, {"study": str(study.path),
                                    "cells": {**recorded, **{cell.name: cell.config_hash for cell in study.cells}}})


def finished(cell: Cell, out: Path) -> bool:
    """A cell whose summary.json is of this very experiment and covers its planned rounds."""
    from htfl_dist.metrics.report import read_summary

    summary = read_summary(cell.run_dir(out))
    return (summary is not None and summary.get("config_hash") == cell.config_hash
            and summary.get("rounds", 0) >= cell.rounds)
