"""Standardize feature columns and pack them into one float32 vector column, assigning balanced shards.

The body runs under `DataFrame.mapInArrow`: it sees one partition as Arrow record batches and returns
record batches, so no row ever becomes a Python object.
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

FEATURES = "features"
LABEL = "label"
SPLIT = "split"
SHARD = "shard"


def output_schema_ddl(label_is_integer: bool) -> str:
    return f"{FEATURES} array<float>, {LABEL} {'bigint' if label_is_integer else 'double'}, {SPLIT} string, {SHARD} int"


def make_pack_fn(
    feature_columns: Sequence[str],
    label_column: str,
    split_column: str,
    means: Sequence[float] | None,
    stds: Sequence[float] | None,
    split_offsets: Mapping[str, Mapping[int, int]],
    num_shards: Mapping[str, int],
    label_is_integer: bool,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Build the mapInArrow body.

    split_offsets[split][partition_id] is the number of rows of `split` in all earlier partitions, so
    (offset + position within this partition) is a global row index and `index % shards` deals rows out
    round-robin: shard row counts then differ by at most one.
    """
    columns = list(feature_columns)
    mean = None if means is None else np.asarray(means, dtype=np.float64)
    inv_std = None if stds is None else 1.0 / np.asarray(stds, dtype=np.float64)
    offsets = {split: dict(parts) for split, parts in split_offsets.items()}
    shards = dict(num_shards)
    label_type = pa.int64() if label_is_integer else pa.float64()

    def pack(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        seen: dict[str, int] = {}
        for batch in batches:
            if batch.num_rows == 0:
                continue
            matrix = np.column_stack([
                batch.column(name).to_numpy(zero_copy_only=False).astype(np.float64, copy=False) for name in columns
            ]) if columns else np.empty((batch.num_rows, 0))
            if mean is not None:
                matrix = (matrix - mean) * inv_std
            values = pa.array(matrix.astype(np.float32, copy=False).reshape(-1))
            features = pa.ListArray.from_arrays(
                pa.array(np.arange(0, matrix.size + 1, len(columns), dtype=np.int32)), values)
            splits = batch.column(split_column).to_numpy(zero_copy_only=False)
            shard = np.empty(batch.num_rows, dtype=np.int32)
            for name in np.unique(splits):
                mask = splits == name
                start = offsets[name].get(partition, 0) + seen.get(name, 0)
                count = int(mask.sum())
                shard[mask] = (np.arange(start, start + count) % shards[name]).astype(np.int32)
                seen[name] = seen.get(name, 0) + count
            yield pa.RecordBatch.from_arrays(
                [features, batch.column(label_column).cast(label_type), pa.array(splits, pa.string()), pa.array(shard)],
                names=[FEATURES, LABEL, SPLIT, SHARD],
            )

    return pack
