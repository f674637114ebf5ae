"""Read run directories back and compare them: a Markdown table, a CSV of the rounds, learning curves.

The one place that turns a run directory (``metrics.jsonl``, ``config.yaml``, ``summary.json``)
into numbers, so the ``python -m htfl_dist.report`` CLI and the benchmarks summarise runs the same
way. Runs still in progress are normal input: no ``summary.json`` yet, and possibly a last
metrics line that is being written. matplotlib is imported only by :func:`plot_curves`.
"""
from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from htfl_dist.atomic import replaced_atomically
from htfl_dist.errors import HtflError
from htfl_dist.metrics.writer import MetricsFileError, read_rows, write_atomic
from htfl_dist.privacy import withheld_reason

METRICS_FILE, CONFIG_FILE, SUMMARY_FILE = "metrics.jsonl", "config.yaml", "summary.json"
PER_CLIENT_FILE = "per_client.jsonl"
"""One row per evaluated round with every tested client's own figures, beside metrics.jsonl's
pooled ones (a mean hides the clients a federation serves badly)."""
RUN_DIRECTORY = (f"a run directory is the --out of `python -m htfl_dist.main` and holds {METRICS_FILE}, "
                 f"{CONFIG_FILE} and, once finished, {SUMMARY_FILE}")
CONFIG_HINT = f"{CONFIG_FILE} is the resolved config `python -m htfl_dist.main` writes; restore it or leave the run out"
# Columns every metrics row has, in the order docs/running.md's "Outputs" lists them; CSV files put them first.
CORE_COLUMNS = ("round", "test_acc", "test_acc_head", "test_acc_std", "train_loss", "bytes_up", "bytes_down",
                "bytes_theory_up", "bytes_theory_down", "seconds", "client_s", "server_s", "comm_s")
TABLE_COLUMNS = ("run", "algorithm", "dataset", "partition", "model", "seed", "rounds", "best acc % (round)",
                 "last acc %", "last head acc %", "s/round", "server s/round (share)", "MB up/round", "up/theory")


class ReportError(HtflError):
    """A path or option of the report cannot be used (not a run directory, damaged file, unknown metric)."""


__all__ = ["MetricsFileError", "ReportError", "RunRecord", "read_rows", "read_run", "read_summary", "summarise"]


@dataclass(frozen=True)
class RunRecord:
    """One run directory as read back: the resolved config, the summary (None until the run
    finishes all its planned rounds) and the evaluated rounds' metrics rows, in file order."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    rows: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.path.name


def read_run(path: str | Path) -> RunRecord:
    """Read a run directory, finished or still running (see :func:`read_rows`)."""
    path = Path(path)
    metrics, config_file = path / METRICS_FILE, path / CONFIG_FILE
    if not metrics.is_file() and not config_file.is_file():
        reason = ("does not exist" if not path.exists() else "is a file" if not path.is_dir()
                  else f"has neither {METRICS_FILE} nor {CONFIG_FILE}")
        raise ReportError(f"{path} is not a run directory: it {reason}; {RUN_DIRECTORY}")
    if not config_file.is_file():
        raise ReportError(f"{path} has {METRICS_FILE} but no {CONFIG_FILE}; {RUN_DIRECTORY}")
    config = _read_config(config_file)
    summary = read_summary(path)
    if summary is not None and summary.get("rounds", 0) < config.get("rounds", 0):
        summary = None  # left by an earlier end of the run, before `--resume auto rounds=MORE`
    rows = read_rows(metrics) if metrics.is_file() else []  # started, first round not evaluated yet
    return RunRecord(path, config, summary, rows)


def _read_config(config_file: Path) -> dict[str, Any]:
    """The run's resolved config as a mapping; a damaged or foreign file is a one-line error,
    not a YAML traceback here or an AttributeError where a key is looked up later."""
    try:
        config = yaml.safe_load(config_file.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)  # the parser's message spans lines; its position does not
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ReportError(f"{config_file}: not a run config (invalid YAML{where}); {CONFIG_HINT}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ReportError(f"{config_file}: not a run config (a YAML {type(config).__name__}, not a mapping); "
                          f"{CONFIG_HINT}")
    return config


def read_summary(path: str | Path) -> dict[str, Any] | None:
    """The run's ``summary.json``, or None while the run has not finished (it is written last,
    atomically, so it is either absent or complete)."""
    summary = Path(path) / SUMMARY_FILE
    if not summary.exists():
        return None
    try:
        return json.loads(summary.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{summary}: not valid JSON ({exc.msg}, line {exc.lineno}); "
                          f"delete it and the run counts as unfinished") from None


# ---------------------------------------------------------------------------------------- summaries

def summarise(run: RunRecord) -> dict[str, Any]:
    """The numbers that compare runs: what was run, how far it got, accuracy, time and traffic.
    Means are over the evaluated rounds (the rows), so an unfinished run summarises what it has;
    a value a run has no rows for yet is None."""
    return {**_identity(run), **accuracy_summary(run.rows), **_cost(run.rows)}


def _identity(run: RunRecord) -> dict[str, Any]:
    data, model = run.config.get("data") or {}, run.config.get("model") or {}
    return {
        "run": run.name,
        "algorithm": run.config.get("algorithm"),
        "dataset": data.get("dataset"),
        "partition": data.get("partition"),
        "model_group": model.get("group"),  # a custom group is stored comma-separated
        "seed": run.config.get("seed"),
        "rounds_done": run.rows[-1]["round"] if run.rows else 0,
        "rounds_planned": run.config.get("rounds"),
        "finished": run.summary is not None,
    }


def accuracy_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best (earliest of equal bests) and last accuracy of metrics rows: what summary.json and the
    report both state, computed in this one place."""
    evaluated = [row for row in rows if _is_number(row.get("test_acc"))]
    best = max(evaluated, key=lambda row: row["test_acc"], default=None)  # the earliest of equal bests
    last = evaluated[-1] if evaluated else {}
    heads = [row["test_acc_head"] for row in evaluated if _is_number(row.get("test_acc_head"))]
    return {
        "best_test_acc": best["test_acc"] if best else None,
        "best_round": best["round"] if best else None,
        "last_test_acc": last.get("test_acc"),
        "last_test_acc_head": last.get("test_acc_head"),
        "best_test_acc_head": max(heads, default=None),
    }


def _cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    seconds, server_s = mean_of(rows, "seconds"), mean_of(rows, "server_s")
    ratios = [row["bytes_up"] / row["bytes_theory_up"] for row in rows
              if _is_number(row.get("bytes_up")) and row.get("bytes_theory_up")]
    return {
        "seconds_per_round": seconds,
        "server_s": server_s,
        "server_share": server_s / seconds if seconds and server_s is not None else None,
        "bytes_up_per_round": mean_of(rows, "bytes_up"),
        "max_bytes_up_over_theory": max(ratios, default=None),
        # a broadcast counts once per client rank, the papers' count once per participating client
        "bytes_down_per_round": mean_of(rows, "bytes_down"),
        "bytes_theory_down_per_round": mean_of(rows, "bytes_theory_down"),
    }


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if _is_number(row.get(key))]
    return statistics.fmean(values) if values else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def numeric_keys(runs: Sequence[RunRecord]) -> list[str]:
    """The metrics that can be tabulated or plotted: keys with a number in some row of some run
    (but not ``round``, the x axis)."""
    keys = {key for run in runs for row in run.rows for key, value in row.items() if _is_number(value)}
    return sorted(keys - {"round"})


def withheld_runs(runs: Sequence[RunRecord], metric: str) -> dict[str, str]:
    """Label → reason, for the runs that do not record ``metric`` by design (a private run keeps
    each client's training loss on the client)."""
    reasons = {label: withheld_reason(run.config, metric) for label, run in zip(run_labels(runs), runs, strict=True)}
    return {label: reason for label, reason in reasons.items() if reason is not None}


def check_metric(runs: Sequence[RunRecord], metric: str) -> None:
    """Refuse a metric no run logged, listing the ones that can be asked for (or saying why the
    runs do not record it)."""
    available = numeric_keys(runs)
    if metric not in available:
        withheld = withheld_runs(runs, metric)
        if withheld:
            raise ReportError(f"'{metric}' is not recorded in {', '.join(withheld)}: {next(iter(withheld.values()))}")
        choices = ", ".join(available) or "none: no round has been evaluated yet"
        raise ReportError(f"unknown metric '{metric}'; numeric keys in these runs: {choices}")


def is_percent(metric: str) -> bool:
    """Accuracies (and their spread over clients) are fractions in the rows, shown in percent."""
    return metric.startswith("test_acc")


# ---------------------------------------------------------------------------------------- table

def run_labels(runs: Sequence[RunRecord]) -> list[str]:
    """A short, distinct name per run: the directory name, with as many parent folders as it
    takes to tell apart runs whose directories share a name (a/fedproto vs b/fedproto)."""
    paths = [run.path.resolve().parts for run in runs]
    for depth in range(1, max((len(parts) for parts in paths), default=1) + 1):
        labels = ["/".join(parts[-depth:]) for parts in paths]
        if len(set(labels)) == len(labels):
            return labels
    return labels  # the same directory given twice: nothing tells the two apart


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table: header row, separator, one line per row (no trailing newline)."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def report_table(runs: Sequence[RunRecord], metric: str | None = None,
                 time_to: Sequence[float] = (), x: str = "round") -> str:
    """One row per run (see :func:`summarise`); ``metric`` adds a column with its last logged value;
    each ``time_to`` accuracy (in percent) a column with the ``x`` at which the run first reached
    it (:func:`time_to_reach`), "-" for a run that never did."""
    if metric is not None:
        check_metric(runs, metric)
    if time_to and x != "round":
        check_metric(runs, x)
    header = [*TABLE_COLUMNS, *([f"last {metric}"] if metric else []),
              *(f"{x} to {target:g} %" for target in time_to)]
    rows = []
    for label, run in zip(run_labels(runs), runs, strict=True):
        cells = _table_cells(summarise(run))
        cells[0] = label
        if metric:
            cells.append(_format_metric(metric, last_value(run.rows, metric)))
        cells += [_number(time_to_reach(run.rows, target / 100.0, x), ".4g") for target in time_to]
        rows.append(cells)
    return markdown_table(header, rows)


def time_to_reach(rows: Sequence[dict[str, Any]], accuracy: float, x: str = "round") -> float | None:
    """The ``x`` (round, or e.g. ``sim_clock_s``) of the first row whose ``test_acc`` is at least
    ``accuracy`` (a fraction), or None if no row reached it. Time-to-accuracy is how
    asynchronous and synchronous federations compare on one clock (FedBuff §5): the same
    accuracy, reached after how many simulated seconds."""
    for row in rows:
        if _is_number(row.get("test_acc")) and row["test_acc"] >= accuracy and _is_number(row.get(x)):
            return float(row[x])
    return None


def _table_cells(s: dict[str, Any]) -> list[str]:
    share = f" ({s['server_share'] * 100:.1f} %)" if s["server_share"] is not None else ""
    return [
        s["run"], _text(s["algorithm"]), _text(s["dataset"]), _text(s["partition"]), _text(s["model_group"]),
        _text(s["seed"]), f"{s['rounds_done']}/{_text(s['rounds_planned'])}",
        f"{_percent(s['best_test_acc'])} ({_text(s['best_round'])})", _percent(s["last_test_acc"]),
        _percent(s["last_test_acc_head"]), _number(s["seconds_per_round"], ".2f"),
        _number(s["server_s"], ".3f") + share, _number(_scaled(s["bytes_up_per_round"], 1e-6), ".3f"),
        _number(s["max_bytes_up_over_theory"], ".4f"),
    ]


def last_value(rows: list[dict[str, Any]], metric: str) -> float | None:
    """The metric in the last row that has it as a number (None: no row does)."""
    return next((row[metric] for row in reversed(rows) if _is_number(row.get(metric))), None)


def _format_metric(metric: str, value: float | None) -> str:
    return _percent(value) if is_percent(metric) else _number(value, ".4g")


def _percent(value: float | None) -> str:
    return _number(_scaled(value, 100.0), ".2f")


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


# ---------------------------------------------------------------------------------------- CSV and plot

def rounds_csv(runs: Sequence[RunRecord]) -> str:
    """Every run's rows in one CSV: ``run`` first, then the columns every row has, then the rest
    alphabetically (the union over runs, so one layout fits all). Lists are JSON strings; a
    value a run did not log is empty."""
    keys = {key for run in runs for row in run.rows for key in row}
    columns = [key for key in CORE_COLUMNS if key in keys] + sorted(keys.difference(CORE_COLUMNS))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", *columns])
    for label, run in zip(run_labels(runs), runs, strict=True):
        writer.writerows([label, *(_csv_cell(row.get(key)) for key in columns)] for row in run.rows)
    return buffer.getvalue()


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, list | dict) else value


def write_csv(runs: Sequence[RunRecord], out: Path) -> None:
    """Write :func:`rounds_csv` to ``out`` atomically."""
    write_atomic(Path(out), rounds_csv(runs))


def identical_curves(runs: Sequence[RunRecord], metric: str) -> list[list[str]]:
    """Runs whose ``metric`` curves are the same points, grouped by label in the order given
    (a group of one is a curve of its own). Same world-size-invariant run on 1 and 3 ranks, or two
    seeds that did not change anything: a plot would draw them on top of each other."""
    groups: dict[tuple, list[str]] = {}
    for label, run in zip(run_labels(runs), runs, strict=True):
        points = tuple((row["round"], row[metric]) for row in run.rows if _is_number(row.get(metric)))
        groups.setdefault(points, []).append(label)
    return [labels for points, labels in groups.items() if points]


def plot_curves(runs: Sequence[RunRecord], metric: str = "test_acc", *, out: Path,
                x: str = "round") -> list[list[str]]:
    """One line per distinct curve of ``metric`` against ``x`` (the round, or a numeric key such as
    ``sim_clock_s``: accuracy against simulated time), as a PNG written atomically to ``out``;
    accuracies are drawn in percent. Rows that did not log both are left out. Runs with identical
    curves share one line labelled "a = b (identical)"; those groups are returned so the caller
    can say so too."""
    check_metric(runs, metric)
    if x != "round":
        check_metric(runs, x)
    figure = new_figure()
    axes = figure.add_subplot()
    scale = 100.0 if is_percent(metric) else 1.0
    by_label = dict(zip(run_labels(runs), runs, strict=True))
    groups = identical_curves(runs, metric)
    for labels in groups:
        run = by_label[labels[0]]
        points = [(row[x], row[metric] * scale) for row in run.rows
                  if _is_number(row.get(metric)) and _is_number(row.get(x))]
        rounds, values = zip(*points, strict=True)
        label = labels[0] if len(labels) == 1 else " = ".join(labels) + " (identical)"
        axes.plot(rounds, values, label=label, marker="o" if len(points) <= 30 else None, markersize=3,
                  linestyle="-" if len(labels) == 1 else "--")
    withheld = withheld_runs(runs, metric)
    if withheld:  # a run missing from the plot says why
        figure.text(0.01, 0.005, f"not recorded in {', '.join(withheld)}: {next(iter(withheld.values()))}",
                    fontsize="x-small", wrap=True)
    axes.set_title(f"{metric} per round" if x == "round" else f"{metric} against {x}")
    axes.set_xlabel(x)
    axes.set_ylabel(f"{metric} (%)" if is_percent(metric) else metric)
    if x == "round":
        axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    save_figure(figure, out)
    return [labels for labels in groups if len(labels) > 1]


def save_figure(figure, out: Path) -> None:
    """Write ``figure`` as a PNG at ``out`` atomically: a reader never sees half an image."""
    with replaced_atomically(out) as tmp:
        figure.savefig(tmp, format="png")


def new_figure(size: tuple[float, float] = (8, 5)):
    """A matplotlib figure on the Agg canvas (no display, no pyplot state); matplotlib is
    imported here so that reading and tabulating runs do not pay for it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("plots need matplotlib, which is not installed: pip install matplotlib") from None
    figure = Figure(figsize=size, dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    return figure
