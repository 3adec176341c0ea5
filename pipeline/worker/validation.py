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

A rank's part is read row group by row group each epoch (``ValidationPart``), never whole: at 16M rows the
whole part, held for the run plus a second copy while its row groups were joined, nearly doubled a rank's
memory (575 -> 1,085 MB, issue 47). It is kept in memory between epochs only when it fits
``data.validation_cache_mb`` (a re-read costs a Parquet decode of the part per epoch; a kept part costs
its size for the whole run).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

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


class ValidationPart:
    """This rank's rows ``rows`` of the validation ``files``, as (inputs, labels) tensors on ``device``,
    one row group at a time (``pipeline.data.loader.row_groups``, the training loader's column reader).

    The first epoch's pass measures the part from its first row group (bytes per row x the part's rows):
    within ``cache_bytes`` its row groups are kept for the later epochs, else every epoch reads them again
    and at most one row group (and the chunk being evaluated) is held at once."""

    def __init__(self, files: Sequence[str], rows: Optional[tuple[int, int]], *, features_field: str,
                 label_field: str, num_features: Optional[int], features, device: str, cache_bytes: int,
                 read: Optional[Callable] = None):
        self._files, self._rows, self._device = tuple(files), rows, device
        self._fields = (features_field, label_field, num_features, features)
        self._cache_bytes, self._read = cache_bytes, read
        self._kept: Optional[list] = None  # the row groups, once a pass kept them all
        self.cached: Optional[bool] = None  # decided by the first pass

    def __iter__(self) -> Iterator[tuple[dict, object]]:
        if self._kept is not None:
            yield from self._kept
            return
        from pipeline.data.batch import to_device
        from pipeline.data.loader import as_tensors, row_groups

        keep: Optional[list] = [] if self.cached else None
        for x, y in row_groups(self._files, *self._fields, rows=self._rows, read=self._read):
            if self.cached is None:  # the first pass decides, from its first row group
                self.cached = self._fits(x, y)
                keep = [] if self.cached else None
            x, y = as_tensors(x, y)
            if self._device != "cpu":
                x, y = to_device(x, self._device), y.to(self._device)
            if keep is not None:
                keep.append((x, y))
            yield x, y
        self._kept = keep

    def _part_rows(self) -> int:
        if self._rows is not None:
            return self._rows[1] - self._rows[0]
        from pipeline.data.loader import file_rows

        return file_rows(self._files)

    def _fits(self, x: dict, y) -> bool:
        rows = len(y)
        width = sum(v.nbytes for v in x.values()) + y.nbytes
        estimate = width / max(rows, 1) * self._part_rows()
        fits = estimate <= self._cache_bytes
        log.debug("validation part %s: ~%.0f MiB, %s (data.validation_cache_mb=%.0f)", self._rows, estimate / 2**20,
                  "kept in memory" if fits else "read again each epoch", self._cache_bytes / 2**20)
        return fits


def evaluate_part(model, loss, weight_of, part: Iterable[tuple[dict, object]], task: str) -> dict[str, float]:
    """This rank's sums over its part: ``part`` yields (features, labels) tensors on the model's device (a
    ValidationPart's row groups, or one (features, labels) pair), evaluated in chunks of ``CHUNK_ROWS`` rows;
    the model is left in train mode."""
    import torch

    rows = 0
    loss_sum = weight = 0.0
    correct = 0
    model.eval()
    try:
        with torch.no_grad():
            for features, labels in part:
                count = int(labels.shape[0])
                rows += count
                for start in range(0, count, CHUNK_ROWS):
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

