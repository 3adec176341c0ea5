"""Standardize feature columns and pack them into one float32 vector column, assigning balanced shards.

The generator runs inside the shard writer's `DataFrame.mapInArrow` body (udfs/shard_writer.py): it sees
one partition as Arrow record batches and yields record batches, so no row ever becomes a Python object.
Features come out as a fixed_size_list<float> column (one contiguous float32 buffer per batch).
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from udfs.profile import invalid_flags, value_set

FEATURES = "features"
LABEL = "label"
SPLIT = "split"
SHARD = "shard"


class ShardDealer:
    """Deals a partition's rows round-robin into shards by their global index within their split.

    split_offsets[split][partition_id] is the number of rows of `split` in all earlier partitions, so
    (offset + position within this partition) is a global row index and `index % shards` deals rows out:
    shard row counts then differ by at most one. split_rows[split][partition_id] is what the profile pass
    counted there; a partition that now holds other rows means the source changed between the passes, and
    the shards would be unbalanced, so the task fails instead."""

    def __init__(self, split_offsets: Mapping[str, Mapping[int, int]], split_rows: Mapping[str, Mapping[int, int]],
                 num_shards: Mapping[str, int]):
        self.offsets = {split: dict(parts) for split, parts in split_offsets.items()}
        self.expected = {split: dict(parts) for split, parts in split_rows.items()}
        self.shards = dict(num_shards)

    def deal(self, partition: int, splits: np.ndarray, seen: dict[str, int]) -> np.ndarray:
        shard = np.empty(len(splits), dtype=np.int32)
        for name in np.unique(splits):
            mask = splits == name
            start = self.offsets[name].get(partition, 0) + seen.get(name, 0)
            count = int(mask.sum())
            shard[mask] = (np.arange(start, start + count) % self.shards[name]).astype(np.int32)
            seen[name] = seen.get(name, 0) + count
        return shard

    def check(self, partition: int, seen: Mapping[str, int]) -> None:
        for name in set(self.expected) | set(seen):
            if seen.get(name, 0) != self.expected.get(name, {}).get(partition, 0):
                raise RuntimeError(
                    f"partition {partition} now holds {seen.get(name, 0)} {name} rows but the profile pass "
                    f"counted {self.expected.get(name, {}).get(partition, 0)}: the ETL source changed (or is not "
                    "deterministic) between its two reads; re-run the ETL on a stable source")


def label_indexer(label_classes: Sequence[str] | None, numeric_labels: bool) -> Callable[[pa.Array], pa.Array]:
    """Label column -> int64 class indices (classification: each value's position in label_classes, as
    text or as integers) or float64 values (regression: label_classes None)."""
    classes = None
    if label_classes is not None:
        classes = pa.array([int(c) for c in label_classes], pa.int64()) if numeric_labels else pa.array(
            list(label_classes), pa.string())

    def labels_of(column: pa.Array) -> pa.Array:
        if classes is None:
            return column.cast(pa.float64())
        values = column.cast(pa.int64()) if numeric_labels else column.cast(pa.string())
        return pc.index_in(values, value_set=classes).cast(pa.int64())

    return labels_of


def make_pack_fn(
    feature_columns: Sequence[str],
    label_column: str,
    split_column: str,
    means: Sequence[float] | None,
    stds: Sequence[float] | None,
    split_offsets: Mapping[str, Mapping[int, int]],
    split_rows: Mapping[str, Mapping[int, int]],
    num_shards: Mapping[str, int],
    label_classes: Sequence[str] | None,
    numeric_labels: bool,
    float_columns: Sequence[str],
    other_checked_columns: Sequence[str],
    restrict_labels: bool = False,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Build the mapInArrow body (shards dealt by ShardDealer).

    label_classes (classification) maps each label value, as text, to its index in the list. Rows with
    null/NaN/inf in float_columns or null in other_checked_columns are dropped (the profile counted them),
    and so are rows whose label is not in label_classes when restrict_labels (configured data.classes).
    """
    columns = list(feature_columns)
    mean = None if means is None else np.asarray(means, dtype=np.float64)
    inv_std = None if stds is None else 1.0 / np.asarray(stds, dtype=np.float64)
    floats, others = list(float_columns), list(other_checked_columns)
    dealer = ShardDealer(split_offsets, split_rows, num_shards)
    labels_of = label_indexer(label_classes, numeric_labels)
    allowed = {label_column: value_set(label_classes, numeric_labels)} if restrict_labels and label_classes else None

    def pack(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        seen: dict[str, int] = {}
        for batch in batches:
            if batch.num_rows == 0:
                continue
            valid = ~invalid_flags(batch, floats, others, allowed).any(axis=1)
            if not valid.all():
                batch = batch.filter(pa.array(valid))
                if batch.num_rows == 0:
                    continue
            matrix = np.empty((batch.num_rows, len(columns)), dtype=np.float32)
            for j, name in enumerate(columns):
                column = batch.column(name).to_numpy(zero_copy_only=False)
                matrix[:, j] = column if mean is None else (column - mean[j]) * inv_std[j]
            features = pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), len(columns))
            splits = batch.column(split_column).to_numpy(zero_copy_only=False)
            shard = dealer.deal(partition, splits, seen)
            yield pa.RecordBatch.from_arrays(
                [features, labels_of(batch.column(label_column)), pa.array(splits, pa.string()), pa.array(shard)],
                names=[FEATURES, LABEL, SPLIT, SHARD],
            )
        dealer.check(partition, seen)

    return pack
