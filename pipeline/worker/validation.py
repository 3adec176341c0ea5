"""The validation split at the end of each epoch: every rank evaluates its part, the driver adds them up.

Why every rank a part, not rank 0 the whole split: a synchronous exchange (sync PS, allreduce) makes the
ranks that finished their epoch wait at the next epoch's first step for the one still evaluating. With
rank 0 evaluating alone, N-1 ranks sat idle for the whole evaluation every epoch: at 2 workers on the
4.4 MB MLP with 10k validation rows, rank 1 waited ~0.6 s per 4 s epoch for it
(``bench/step_profile_bench.py --epochs 3``: its pull wait 7-9 ms per step against rank 0's 2.4 ms).
Split N ways, each rank spends 1/N of that time and none waits for another.

Each rank reports sums, not means: its loss times the loss's own denominator
(``pipeline.models.losses.loss_weight``: the row count, or the sum of the class weights of its rows for a
weighted cross entropy), that denominator, its rows and, for classification, its correct predictions. The
driver's ``combine`` divides the totals, so ``val_loss`` and ``val_accuracy`` are the whole split's,
whatever size each part has, up to float rounding.
"""
from __future__ import annotations

from typing import Iterable

# Rows per forward pass: the activations of a large validation split in one pass (a 500k-row split through
# 1024-wide layers: ~2 GB) would not fit where a training batch does. Eval mode makes chunks independent.
CHUNK_ROWS = 8192
SUM_KEYS = ("val_loss_sum", "val_weight", "val_rows", "val_correct")


def part_rows(total: int, part: int, parts: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``total``-row split that part ``part`` of ``parts`` evaluates (sizes
    differ by at most one row; a part is empty when there are fewer rows than parts)."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}: a part is in [0, {parts})")
    return total * part // parts, total * (part + 1) // parts


def evaluate_part(model, loss, weight_of, features: dict, labels, task: str) -> dict[str, float]:
    """This rank's sums over its part (``features``/``labels`` as ``pipeline.data.read_tensors`` gives
    them, on the model's device), in chunks of ``CHUNK_ROWS`` rows; the model is left in train mode."""
    import torch

    rows = int(labels.shape[0])
    loss_sum = weight = 0.0
    correct = 0
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, rows, CHUNK_ROWS):
                x = {key: value[start:start + CHUNK_ROWS] for key, value in features.items()}
                y = labels[start:start + CHUNK_ROWS]
                output = model(x)
                share = weight_of(y)
                loss_sum += float(loss(output, y)) * share
                weight += share
                if task == "classification":
                    correct += int((output.argmax(dim=1) == y).sum())
    finally:
        model.train()
    sums = {"val_loss_sum": loss_sum, "val_weight": weight, "val_rows": rows}
    if task == "classification":
        sums["val_correct"] = correct
    return sums


def combine(reports: Iterable[dict]) -> dict[str, float]:
    """The epoch row's ``val_loss`` (and ``val_accuracy``) from the ranks' sums, and ``val_rows``, the rows
    they cover (fewer than the split's in an epoch summarized without a rank that died); {} when no rank
    evaluated."""
    parts = [r for r in reports if "val_rows" in r]
    weight = sum(float(r["val_weight"]) for r in parts)
    if not parts or weight <= 0:
        return {}
    row = {"val_loss": sum(float(r["val_loss_sum"]) for r in parts) / weight}
    rows = sum(int(r["val_rows"]) for r in parts)
    row["val_rows"] = rows
    if all("val_correct" in r for r in parts) and rows:
        row["val_accuracy"] = sum(int(r["val_correct"]) for r in parts) / rows
    return row

