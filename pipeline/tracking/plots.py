"""Matplotlib figures for a run: confusion matrix, training curves and pipeline-stage time (Agg canvas,
no pyplot)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

_MAX_ANNOTATED_CLASSES = 30
# The figure's side in inches (at 100 dpi) stops growing here: 0.5 inch per class made a 300-class figure
# 152 inches square, 6.3 GB of canvas in the driver; capped, a figure is at most ~2400 px square (~25 MB).
_MAX_SIDE_INCHES = 24.0
_MAX_LABELLED_CLASSES = 60  # tick labels past this overlap into a black band: left out


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def confusion_figure(confusion: np.ndarray, class_names: Sequence[str]):
    """Heat map of a confusion matrix (rows: true class, columns: predicted), counts written in each cell."""
    n = len(class_names)
    side = min(max(4.0, 0.5 * n + 2.0), _MAX_SIDE_INCHES)
    fig = _new_figure(side + 1.0, side)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(confusion, cmap="Blues", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set(xlabel="predicted", ylabel="true", title="Confusion matrix")
    if n <= _MAX_LABELLED_CLASSES:
        ax.set(xticks=range(n), yticks=range(n))
        ax.set_xticklabels(class_names, rotation=45 if n > 5 else 0, ha="right" if n > 5 else "center")
        ax.set_yticklabels(class_names)
    if n <= _MAX_ANNOTATED_CLASSES:
        threshold = confusion.max() / 2 if confusion.size else 0
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{confusion[i, j]:g}", ha="center", va="center", fontsize=8,
                        color="white" if confusion[i, j] > threshold else "black")
    fig.tight_layout()
    return fig


def history_figure(history: Sequence[Mapping[str, float]]):
    """Loss curves (keys ending in ``loss``) and accuracy curves (keys containing ``acc``) per epoch.

    Returns None when the history holds neither.
    """
    keys = sorted({k for row in history for k in row if k != "epoch"})
    panels = [("loss", [k for k in keys if k.endswith("loss")]),
              ("accuracy", [k for k in keys if "acc" in k])]
    panels = [(title, ks) for title, ks in panels if ks]
    if not panels:
        return None
    fig = _new_figure(6.0 * len(panels), 4.0)
    for index, (title, panel_keys) in enumerate(panels, start=1):
        ax = fig.add_subplot(1, len(panels), index)
        for key in panel_keys:
            points = [(row.get("epoch", i), row[key]) for i, row in enumerate(history) if row.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set(xlabel="epoch", ylabel=title, title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def stage_figure(history: Sequence[Mapping[str, float]]):
    """Pipeline parallelism: per stage, compute vs idle (bubble) seconds summed over epochs, and the
    bubble fraction per epoch. Returns None without ``stage<p>/...`` keys (no pipeline stages)."""
    stages = sorted({int(k[5:].split("/", 1)[0]) for row in history for k in row
                     if k.startswith("stage") and k.endswith("/compute_s")})
    if not stages:
        return None
    compute = [sum(row.get(f"stage{s}/compute_s", 0.0) for row in history) for s in stages]
    idle = [sum(row.get(f"stage{s}/idle_s", 0.0) for row in history) for s in stages]
    fig = _new_figure(11.0, 4.0)
    ax = fig.add_subplot(1, 2, 1)
    labels = [f"stage {s}" for s in stages]
    ax.bar(labels, compute, label="compute")
    ax.bar(labels, idle, bottom=compute, label="idle (bubble + transfer)")
    ax.set(ylabel="seconds (all epochs, mean over replicas)", title="Where each stage's time went")
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    for s in stages:
        points = [(row.get("epoch", i), row[f"stage{s}/bubble_fraction"]) for i, row in enumerate(history)
                  if row.get(f"stage{s}/bubble_fraction") is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, label=f"stage {s}")
    ax.set(xlabel="epoch", ylabel="idle / (idle + compute)", title="Bubble fraction", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
