"""The pack step of typed features: raw columns -> each feature in its own dtype, dealt into shards.

Runs inside the shard writer's `mapInArrow` body (udfs/shard_writer.py), like udfs/pack.py. The
preprocessing is udfs/transforms.Transform, the same code the served model and `shardline score` run,
so training sees exactly what serving computes. Output columns (see pipeline.config.feature_spec):
`features` fixed_size_list<float32> (the numeric block, if any), `f__<name>` int64 (categorical),
fixed_size_list<float32> (vector), fixed_size_binary(C*H*W) (decoded image pixels: one contiguous byte
buffer, read back 13x faster than a Parquet LIST of uint8, which decodes as INT32 with repetition
levels) or binary (encoded image: the source bytes, decoded by the loader), fixed_size_list<int64> +
`f__<name>__len` int64 (text).
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from udfs.pack import FEATURES, LABEL, SHARD, SPLIT, ShardDealer, label_indexer
from udfs.transforms import NUMERIC_KEY, Transform, image_bytes
from udfs.typed_profile import label_flags

COLUMN_PREFIX = "f__"


def _fixed(values: np.ndarray) -> pa.Array:
    rows = len(values)
    width = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(values).reshape(-1)), width) \
        if rows else pa.FixedSizeListArray.from_arrays(pa.array(np.empty(0, values.dtype)), max(width, 1))


def output_columns(specs: Sequence[dict], arrays: Mapping[str, np.ndarray], table: pa.Table) -> tuple[list, list]:
    """(arrays, names) of the shard columns for the rows in `arrays` / `table` (already filtered)."""
    out, names = [], []
    if NUMERIC_KEY in arrays:
        out.append(_fixed(arrays[NUMERIC_KEY]))
        names.append(FEATURES)
    for spec in specs:
        name, kind = spec["name"], spec["type"]
        if kind == "numeric":
            continue
        column = COLUMN_PREFIX + name
        if kind == "categorical":
            out.append(pa.array(arrays[name], pa.int64()))
        elif kind == "image" and spec.get("storage") == "encoded":
            out.append(pa.array(image_bytes(table.column(name), spec.get("source", "bytes")), pa.binary()))
        elif kind == "image":
            pixels = np.ascontiguousarray(arrays[name], dtype=np.uint8)
            width = int(np.prod(pixels.shape[1:]))
            out.append(pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(pixels),
                                                            [None, pa.py_buffer(pixels.reshape(-1))]))
        else:
            out.append(_fixed(arrays[name]))
        names.append(column)
        if kind == "text":
            out.append(pa.array(arrays[name + "__len"], pa.int64()))
            names.append(column + "__len")
    return out, names


def make_typed_pack_fn(specs: Sequence[dict], vocabularies: Mapping[str, pa.Array], label: str, split_column: str,
                       label_classes: Optional[Sequence[str]], numeric_labels: bool, regression: bool,
                       allowed: Optional[Mapping[str, pa.Array]], split_offsets, split_rows,
                       num_shards) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    transform = Transform(specs, vocabularies)
    dealer = ShardDealer(split_offsets, split_rows, num_shards)
    labels_of = label_indexer(label_classes, numeric_labels)

    def pack(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        seen: dict[str, int] = {}
        for batch in batches:
            if batch.num_rows == 0:
                continue
            table = pa.Table.from_batches([batch])
            arrays, valid, _, _ = transform.apply(table)
            valid &= ~label_flags(batch, label, regression, allowed)
            if not valid.all():
                keep = np.flatnonzero(valid)
                if not len(keep):
                    continue
                arrays = {key: value[keep] for key, value in arrays.items()}
                table = table.take(pa.array(keep))
            columns, names = output_columns(specs, arrays, table)
            splits = table.column(split_column).to_numpy()
            shard = dealer.deal(partition, splits, seen)
            yield pa.RecordBatch.from_arrays(
                columns + [labels_of(table.column(label).combine_chunks()), pa.array(splits, pa.string()),
                           pa.array(shard)], names=names + [LABEL, SPLIT, SHARD])
        dealer.check(partition, seen)

    return pack
