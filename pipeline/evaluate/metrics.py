"""Metric arithmetic from additive partial sums, so Spark partitions can be combined on the driver."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class EvalResult:
    split: str
    rows: int
    metrics: dict[str, float]
    confusion: Optional[np.ndarray] = None
    class_names: Optional[list[str]] = None
    extra: dict = field(default_factory=dict)


def classification_partials(logits: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[loss_sum, count, confusion (k*k, row = true class, column = predicted)] for one batch."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss_sum = -log_probs[np.arange(len(labels)), labels].sum()
    predicted = logits.argmax(axis=1)
    confusion = np.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes)
    return np.concatenate([[loss_sum, len(labels)], confusion]).astype(np.float64)


def regression_partials(predictions: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[sse, sae, sum y, sum y^2, count] for one batch."""
    error = predictions - targets
    return np.array([np.square(error).sum(), np.abs(error).sum(), targets.sum(), np.square(targets).sum(),
                     len(targets)], dtype=np.float64)


def classification_metrics(total: np.ndarray, num_classes: int) -> tuple[dict[str, float], np.ndarray]:
    loss_sum, count = total[0], total[1]
    confusion = total[2:].reshape(num_classes, num_classes).astype(np.int64)
    true_per_class = confusion.sum(axis=1)
    predicted_per_class = confusion.sum(axis=0)
    correct = np.diag(confusion)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(predicted_per_class > 0, correct / predicted_per_class, 0.0)
        recall = np.where(true_per_class > 0, correct / true_per_class, 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    present = true_per_class > 0  # macro average over classes that occur in this split
    metrics = {
        "loss": float(loss_sum / count),
        "accuracy": float(correct.sum() / count),
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "macro_precision": float(precision[present].mean()) if present.any() else 0.0,
        "macro_recall": float(recall[present].mean()) if present.any() else 0.0,
    }
    return metrics, confusion


def regression_metrics(total: np.ndarray) -> dict[str, float]:
    sse, sae, sum_y, sum_y2, count = total
    variance_sum = sum_y2 - sum_y * sum_y / count
    return {
        "mse": float(sse / count),
        "rmse": float(np.sqrt(sse / count)),
        "mae": float(sae / count),
        "r2": float(1.0 - sse / variance_sum) if variance_sum > 0 else float("nan"),
        "loss": float(sse / count),
    }
