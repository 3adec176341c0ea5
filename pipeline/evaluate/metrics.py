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


# Binary classification: the score p(class 1) histogrammed per true class into this many bins, so ROC AUC
# adds up across partitions like every other partial (exact up to ties within a bin: < 1e-3 off).
AUC_BINS = 2048


def classification_partials(logits: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[loss_sum, count, confusion (k*k, row = true class, column = predicted)] for one batch, then for two
    classes the score histograms of the negatives and the positives (AUC_BINS each)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss_sum = -log_probs[np.arange(len(labels)), labels].sum()
    predicted = logits.argmax(axis=1)
    confusion = np.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes)
    parts = [[loss_sum, len(labels)], confusion]
    if num_classes == 2:
        score = np.exp(log_probs[:, 1])
        bins = np.minimum((score * AUC_BINS).astype(np.int64), AUC_BINS - 1)
        parts.append(np.bincount(bins + labels * AUC_BINS, minlength=2 * AUC_BINS))
    return np.concatenate(parts).astype(np.float64)


def roc_auc_from_histograms(negatives: np.ndarray, positives: np.ndarray) -> float:
    """P(score of a random positive > that of a random negative), ties counted half."""
    n_neg, n_pos = negatives.sum(), positives.sum()
    if n_neg == 0 or n_pos == 0:
        return float("nan")
    below = np.cumsum(negatives) - negatives  # negatives in lower bins
    return float((positives * (below + 0.5 * negatives)).sum() / (n_neg * n_pos))


def regression_partials(predictions: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[sse, sae, sum y, sum y^2, count] for one batch."""
    error = predictions - targets
    return np.array([np.square(error).sum(), np.abs(error).sum(), targets.sum(), np.square(targets).sum(),
                     len(targets)], dtype=np.float64)


def classification_metrics(total: np.ndarray, num_classes: int) -> tuple[dict[str, float], np.ndarray]:
    loss_sum, count = total[0], total[1]
    confusion = total[2:2 + num_classes * num_classes].reshape(num_classes, num_classes).astype(np.int64)
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
    if num_classes == 2 and len(total) == 2 + 4 + 2 * AUC_BINS:
        histograms = total[6:].reshape(2, AUC_BINS)
        metrics["roc_auc"] = roc_auc_from_histograms(histograms[0], histograms[1])
        # The binary log loss of p(class 1) is the two-class cross-entropy above: named as users look for it.
        metrics["log_loss"] = metrics["loss"]
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
