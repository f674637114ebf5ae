"""The study's table: one row per cell key with its seeds folded, beside the paper's number.

Accuracies are the runs' best and last test accuracy (summary.json's definitions, through
``htfl_dist.metrics.report.summarise``), as mean ± standard deviation over the seeds. The
deviation is the population one (divide by n), as HtFLlib's result script computes the ± the
papers print. "ours − paper" compares the best accuracy, which is what those tables report.
"""
from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any

from htfl_dist.metrics.report import (
    RunRecord,
    last_value,
    markdown_table,
    new_figure,
    read_run,
    save_figure,
    summarise,
)
from htfl_dist.metrics.writer import write_atomic
from htfl_dist.study.plan import Cell, Study

COLUMNS = ("cell", "seeds", "best acc %", "last acc %", "paper %", "ours − paper", "rounds done/planned",
           "s/round", "server share", "MB up/round", "up/theory")
CSV_COLUMNS = ("cell", "seeds", "best_mean", "best_std", "last_mean", "last_std", "paper", "difference",
               "rounds_done", "rounds_planned", "seconds_per_round", "server_share", "mb_up_per_round",
               "up_over_theory")

LAST_ROUND_COLUMNS = (
    ("worst10", "test_acc_worst10", "last worst-10 % acc %", 100.0),
    ("auc", "test_auc", "last AUC", 1.0),
    ("unseen", "new_client_acc", "last unseen-client acc %", 100.0),
    ("validclass", "test_acc_validclass", "last trained-class acc %", 100.0),
    ("labeldist", "test_acc_labeldist", "last label-weighted acc %", 100.0),
)
"""(name, metrics key, heading, scale): figures of each run's last evaluated row, as mean ± std
over the seeds; a column appears only where some run of the study reports its key (the AUC of a
head with one score per class, unseen clients with ``eval.new_clients``, FedNH's class weightings
with ``eval.test_set=global``)."""


def mean_std(values: list[float]) -> tuple[float, float] | None:
    """Mean and population standard deviation, or None without values."""
    if not values:
        return None
    return statistics.fmean(values), statistics.pstdev(values)


def fold(key: str, records: list[RunRecord], planned_rounds: int, paper: float | None) -> dict[str, Any]:
    """One table row from the runs (seeds) of ``key`` that have started; accuracies in percent."""
    summaries = [summarise(record) for record in records]
    best = mean_std([s["best_test_acc"] * 100 for s in summaries if s["best_test_acc"] is not None])
    last = mean_std([s["last_test_acc"] * 100 for s in summaries if s["last_test_acc"] is not None])
    seconds = [s["seconds_per_round"] for s in summaries if s["seconds_per_round"] is not None]
    server = [s["server_s"] for s in summaries if s["server_s"] is not None]
    ratios = [s["max_bytes_up_over_theory"] for s in summaries if s["max_bytes_up_over_theory"] is not None]
    up = [s["bytes_up_per_round"] for s in summaries if s["bytes_up_per_round"] is not None]
    mean_seconds = statistics.fmean(seconds) if seconds else None
    return {
        "cell": key,
        "seeds": len(records),
        "best_mean": best[0] if best else None, "best_std": best[1] if best else None,
        "last_mean": last[0] if last else None, "last_std": last[1] if last else None,
        "paper": paper,
        "difference": best[0] - paper if best and paper is not None else None,
        "rounds_done": min((s["rounds_done"] for s in summaries), default=0),
        "rounds_planned": planned_rounds,
        "seconds_per_round": mean_seconds,
        "server_share": statistics.fmean(server) / mean_seconds if server and mean_seconds else None,
        "mb_up_per_round": statistics.fmean(up) / 1e6 if up else None,
        "up_over_theory": max(ratios, default=None),
        **last_round_columns(records),
    }


def last_round_columns(records: list[RunRecord]) -> dict[str, float | None]:
    """``LAST_ROUND_COLUMNS`` over the runs: <name>_mean and <name>_std (None where no run has it)."""
    folded: dict[str, float | None] = {}
    for name, key, _, scale in LAST_ROUND_COLUMNS:
        lasts = [last_value(record.rows, key) for record in records]
        values = [value * scale for value in lasts if value is not None]
        stats = mean_std(values)
        folded[f"{name}_mean"], folded[f"{name}_std"] = stats if stats else (None, None)
    return folded


def _reported(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (name, heading) of each ``LAST_ROUND_COLUMNS`` entry that some row has."""
    return [(name, heading) for name, _, heading, _ in LAST_ROUND_COLUMNS
            if any(row.get(f"{name}_mean") is not None for row in rows)]


def study_records(study: Study, out: Path) -> dict[str, list[RunRecord]]:
    """The started cells' run directories, read back, by cell key."""
    records: dict[str, list[RunRecord]] = {key: [] for key in study.keys}
    for cell in study.cells:
        run_dir = cell.run_dir(out)
        if (run_dir / "config.yaml").is_file():
            records[cell.key].append(read_run(run_dir))
    return records


def study_rows(study: Study, out: Path) -> tuple[list[dict[str, Any]], dict[str, list[RunRecord]]]:
    records = study_records(study, out)
    planned = _planned_rounds(study.cells)
    rows = [fold(key, records[key], planned[key], study.paper.get(key)) for key in study.keys]
    return rows, records


def _planned_rounds(cells: list[Cell]) -> dict[str, int]:
    planned: dict[str, int] = {}
    for cell in cells:
        planned[cell.key] = max(planned.get(cell.key, 0), cell.rounds)
    return planned


def _pm(mean: float | None, std: float | None) -> str:
    return "-" if mean is None else f"{mean:.2f} ± {std:.2f}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [[row["cell"], row["seeds"], _pm(row["best_mean"], row["best_std"]), _pm(row["last_mean"], row["last_std"]),
              _fmt(row["paper"], ".2f"), _fmt(row["difference"], "+.2f"),
              f"{row['rounds_done']}/{row['rounds_planned']}", _fmt(row["seconds_per_round"], ".2f"),
              _fmt(None if row["server_share"] is None else row["server_share"] * 100, ".1f", " %"),
              _fmt(row["mb_up_per_round"], ".3f"), _fmt(row["up_over_theory"], ".4f")] for row in rows]
    extra = _reported(rows)
    for line, row in zip(lines, rows, strict=True):
        line += [_pm(row[f"{name}_mean"], row[f"{name}_std"]) for name, _ in extra]
    return markdown_table((*COLUMNS, *(heading for _, heading in extra)), lines)


def csv_text(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    columns = (*CSV_COLUMNS, *(f"{name}_{part}" for name, _ in _reported(rows) for part in ("mean", "std")))
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: "" if row[key] is None else row[key] for key in columns} for row in rows)
    return buffer.getvalue()


def band(records: list[RunRecord], metric: str = "test_acc") -> tuple[list[int], list[float], list[float], list[float]]:
    """Rounds every run evaluated, with the mean, minimum and maximum of ``metric`` over runs there
    (in percent for accuracies)."""
    by_run = [{row["round"]: row[metric] for row in record.rows if isinstance(row.get(metric), int | float)}
              for record in records]
    if not by_run:
        return [], [], [], []
    rounds = sorted(set.intersection(*(set(points) for points in by_run)))
    scale = 100.0 if metric.startswith("test_acc") else 1.0
    values = [[points[r] * scale for points in by_run] for r in rounds]
    return rounds, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot(records: dict[str, list[RunRecord]], out: Path, title: str) -> bool:
    """Mean test accuracy per round of each row, with its min–max band over seeds; False when no
    row has an evaluated round yet (no picture)."""
    curves = {key: band(runs) for key, runs in records.items()}
    curves = {key: curve for key, curve in curves.items() if curve[0]}
    if not curves:
        return False
    from htfl_dist.metrics.figures import _class_colours  # tab10, tab20, then a continuous map: distinct rows

    colour = _class_colours(len(curves))
    figure = new_figure()
    axes = figure.add_subplot()
    for index, (key, (rounds, mean, low, high)) in enumerate(curves.items()):
        axes.plot(rounds, mean, label=f"{key} ({len(records[key])} seed{'s' * (len(records[key]) > 1)})",
                  color=colour(index), marker="o" if len(rounds) <= 30 else None, markersize=3)
        axes.fill_between(rounds, low, high, color=colour(index), alpha=0.2, linewidth=0)
    axes.set_title(f"{title}\ntest_acc per round: mean, min–max band over seeds", fontsize="medium")
    axes.set_xlabel("round")
    axes.set_ylabel("test_acc (%)")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2 if len(curves) > 8 else 1)
    save_figure(figure, out)
    return True


def write_outputs(study: Study, out: Path) -> str:
    """DIR/table.md, DIR/table.csv and DIR/curves.png; returns the Markdown table."""
    rows, records = study_rows(study, out)
    table = markdown(rows)
    write_atomic(out / "table.md", f"# {study.title}\n\n{table}\n")
    write_atomic(out / "table.csv", csv_text(rows))
    plot(records, out / "curves.png", study.title)
    return table
