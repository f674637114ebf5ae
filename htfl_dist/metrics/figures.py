"""Pictures of what the prototypes do, for the run report: FedTGP's Fig. 1 (per class, the
global prototype margin against the largest margin of any client's own prototypes) from the
logged diagnostics, and a 2-D PCA projection of the uploaded and global prototypes of the rounds
that have a snapshot (``output.prototypes_every``). One panel per (run, round), a row per run.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from htfl_dist.metrics.prototypes import GLOBAL_FIELDS, Snapshot, load_snapshot, snapshot_rounds
from htfl_dist.metrics.report import PER_CLIENT_FILE, ReportError, RunRecord, new_figure, run_labels, save_figure
from htfl_dist.metrics.writer import read_rows

MARGIN_KEYS = ("class_margin_global", "class_margin_client_max")
MAX_DEFAULT_PANELS = 4
"""Rounds drawn per run when none are asked for: the first, the last and evenly spaced between."""


def spread_rounds(available: Sequence[int], count: int = MAX_DEFAULT_PANELS) -> list[int]:
    """Up to ``count`` rounds of ``available`` (ascending), first and last included, evenly spaced."""
    if len(available) <= count:
        return list(available)
    picks = {round(i * (len(available) - 1) / (count - 1)) for i in range(count)}
    return [available[i] for i in sorted(picks)]


def _chosen_rounds(available: Sequence[int], asked: Sequence[int] | None, label: str, what: str) -> list[int]:
    if not available:
        raise ReportError(f"{label} has no {what}")
    if not asked:
        return spread_rounds(available)
    missing = sorted(set(asked) - set(available))
    if missing:
        shown = ", ".join(map(str, available[:20])) + (" ..." if len(available) > 20 else "")
        raise ReportError(f"{label} has no {what} for round(s) {', '.join(map(str, missing))}; it has: {shown}")
    return sorted(set(asked))


def _grid(panels_per_row: Sequence[int]):
    """A figure with one row per run and as many columns as the widest row."""
    columns = max(panels_per_row)
    figure = new_figure(size=(4.2 * columns, 3.6 * len(panels_per_row)))
    return figure, [[figure.add_subplot(len(panels_per_row), columns, row * columns + col + 1)
                     for col in range(count)] for row, count in enumerate(panels_per_row)]


# ---------------------------------------------------------------------------------- FedTGP Fig. 1

def margin_rows(run: RunRecord) -> dict[int, dict[str, Any]]:
    """The rows that logged per-class margins, by round."""
    return {row["round"]: row for row in run.rows if all(isinstance(row.get(key), list) for key in MARGIN_KEYS)}


def plot_class_margins(runs: Sequence[RunRecord], out: Path, rounds: Sequence[int] | None = None) -> None:
    """FedTGP Fig. 1: per class, the margin of the global prototype (distance to the nearest other
    global prototype) beside the largest margin any client's own prototypes give that class. A
    class nobody could measure (held by clients with a single class) has no bar."""
    labels = run_labels(runs)
    chosen = []
    for label, run in zip(labels, runs, strict=True):
        by_round = margin_rows(run)
        chosen.append([by_round[r] for r in _chosen_rounds(sorted(by_round), rounds, label,
                                                        "per-class margins (logged by fedtgp)")])
    figure, axes = _grid([len(rows) for rows in chosen])
    for label, rows, row_axes in zip(labels, chosen, axes, strict=True):
        for row, ax in zip(rows, row_axes, strict=True):
            _margin_bars(ax, row)
            ax.set_title(f"{label}: round {row['round']}", fontsize="small")
    axes[0][0].legend(fontsize="small")
    save_figure(figure, out)


def _margin_bars(ax, row: dict[str, Any]) -> None:
    as_float = lambda values: [math.nan if v is None else float(v) for v in values]  # noqa: E731
    global_margin, client_margin = as_float(row[MARGIN_KEYS[0]]), as_float(row[MARGIN_KEYS[1]])
    classes = range(len(global_margin))
    width = 0.4
    ax.bar([c - width / 2 for c in classes], global_margin, width, label="global prototypes")
    ax.bar([c + width / 2 for c in classes], client_margin, width, label="best client")
    ax.set_xlabel("class")
    ax.set_ylabel("margin (distance to nearest other class)")
    if len(global_margin) <= 20:
        ax.set_xticks(list(classes))
    ax.grid(alpha=0.3, axis="y")


# ---------------------------------------------------------------------------------- PCA projection

def pca_2d(vectors: torch.Tensor) -> torch.Tensor:
    """The rows' coordinates on their first two principal components (fewer columns if the rows
    span fewer dimensions), in float64. Signs follow the SVD, so compare shapes, not directions."""
    centred = vectors.double() - vectors.double().mean(dim=0, keepdim=True)
    _, _, basis = torch.linalg.svd(centred, full_matrices=False)
    return centred @ basis[:2].T


def plot_prototype_projection(runs: Sequence[RunRecord], out: Path, rounds: Sequence[int] | None = None) -> None:
    """Per saved round, the uploaded prototypes (dots) and the global class vectors sent down
    (stars: prototypes; crosses: FedSA's anchors) on the first two principal components of that
    round's vectors; the colour is the class."""
    labels = run_labels(runs)
    chosen = [_chosen_rounds(snapshot_rounds(run.path), rounds, label,
                             "prototype snapshots (run with output.prototypes_every=N)")
              for label, run in zip(labels, runs, strict=True)]
    figure, axes = _grid([len(r) for r in chosen])
    for label, run, run_rounds, row_axes in zip(labels, runs, chosen, axes, strict=True):
        for round_number, ax in zip(run_rounds, row_axes, strict=True):
            _projection_panel(ax, load_snapshot(run.path, round_number))
            ax.set_title(f"{label}: round {round_number}", fontsize="small")
    axes[0][0].legend(fontsize="small", title="colour = class", title_fontsize="small")
    save_figure(figure, out)


def _projection_panel(ax, snap: Snapshot) -> None:
    groups = []  # (class ids, vectors, marker style)
    if "upload_protos" in snap:
        groups.append((snap["upload_class_ids"], snap["upload_protos"],
                       {"marker": ".", "s": 18, "alpha": 0.6, "label": "uploaded prototypes"}))
    styles = {"protos": {"marker": "*", "s": 170, "label": "global prototypes"},
              "anchors": {"marker": "X", "s": 110, "label": "anchors"}}
    for name in GLOBAL_FIELDS:
        if f"global_{name}" in snap:
            groups.append((snap["global_class_ids"], snap[f"global_{name}"],
                           {**styles[name], "edgecolors": "black", "linewidths": 0.6}))
    groups = [g for g in groups if g[1].shape[0] > 0]
    if not groups:
        ax.text(0.5, 0.5, "nothing exchanged this round", ha="center", va="center", transform=ax.transAxes)
        return
    points = pca_2d(torch.cat([vectors for _, vectors, _ in groups]))
    if points.shape[1] < 2:
        points = torch.cat([points, torch.zeros(points.shape[0], 2 - points.shape[1], dtype=points.dtype)], dim=1)
    colour = _class_colours(max(int(ids.max()) for ids, _, _ in groups) + 1)
    start = 0
    for class_ids, vectors, style in groups:
        xy = points[start:start + vectors.shape[0]]
        start += vectors.shape[0]
        ax.scatter(xy[:, 0], xy[:, 1], c=[colour(int(c)) for c in class_ids], **style)
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.grid(alpha=0.3)


def _class_colours(num_classes: int):
    from matplotlib import colormaps

    if num_classes <= 10:
        return colormaps["tab10"]
    if num_classes <= 20:
        return colormaps["tab20"]
    cmap = colormaps["turbo"]
    return lambda c: cmap(c / max(num_classes - 1, 1))


# ---------------------------------------------------------------------------------- per-client spread

def per_client_rows(run: RunRecord) -> dict[int, dict[str, Any]]:
    """The run's per_client.jsonl rows, by round (none for a run made before it existed)."""
    path = run.path / PER_CLIENT_FILE
    return {row["round"]: row for row in read_rows(path)} if path.is_file() else {}


def plot_client_spread(runs: Sequence[RunRecord], out: Path, rounds: Sequence[int] | None = None) -> None:
    """Per run, a box of the tested clients' accuracies (%) at each chosen round, and beside it
    the unseen clients' (``eval.new_clients``) where the run has them: the spread a pooled
    accuracy hides, and how the federation's worst clients move."""
    labels = run_labels(runs)
    figure = new_figure(size=(7.0, 3.6 * len(runs)))
    for index, (label, run) in enumerate(zip(labels, runs, strict=True)):
        by_round = per_client_rows(run)
        chosen = _chosen_rounds(sorted(by_round), rounds, label, f"per-client accuracies ({PER_CLIENT_FILE})")
        ax = figure.add_subplot(len(runs), 1, index + 1)
        _client_boxes(ax, [by_round[r] for r in chosen])
        ax.set_title(label, fontsize="small")
    save_figure(figure, out)


def _client_boxes(ax, rows: list[dict[str, Any]]) -> None:
    unseen = any(row.get("new_client_acc") for row in rows)
    width = 0.35 if unseen else 0.6
    positions = range(len(rows))
    federation = ax.boxplot([[100 * a for a in row["test_acc"]] for row in rows], widths=width, patch_artist=True,
                            positions=[p - (width / 2 if unseen else 0) for p in positions])
    handles, names = [federation["boxes"][0]], ["federation's clients"]
    if unseen:
        newcomers = ax.boxplot([[100 * a for a in row.get("new_client_acc", [])] for row in rows], widths=width,
                               positions=[p + width / 2 for p in positions], patch_artist=True)
        for box in newcomers["boxes"]:
            box.set_facecolor("tab:orange")
        handles.append(newcomers["boxes"][0])
        names.append("unseen clients")
    for box in federation["boxes"]:
        box.set_facecolor("tab:blue")
    ax.set_xticks(list(positions), [str(row["round"]) for row in rows])
    ax.set_xlabel("round")
    ax.set_ylabel("client test accuracy %")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(handles, names, fontsize="small")
