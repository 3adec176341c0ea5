"""Small shard file sets read whole into tensors (validation split, input examples, tests).

Training reads through the streaming loader (stream.py); this is for data that fits in memory. The
features column (list<float>) is one flat float32 buffer in Arrow, viewed as an (rows, features) numpy
array and handed to torch without a copy.
"""
from __future__ import annotations

import logging
import warnings
from typing import Sequence

log = logging.getLogger(__name__)


def read_tensors(files: Sequence[str], features_field: str = "features", label_field: str = "label",
                 num_features: int | None = None):
    """Read Parquet shard files into (features float32 [n, d], labels) tensors."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline.errors import DataError, shard_read_error

    if not files:
        raise DataError("no shard files to read for this rank")
    tables = []
    for path in files:
        try:
            tables.append(pq.read_table(path, columns=[features_field, label_field]))
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            raise shard_read_error(f"cannot read shard file {path}: {exc}; re-run `shardline etl`", exc) from None
    table = pa.concat_tables(tables)
    rows = table.num_rows
    column = table.column(features_field).combine_chunks()
    flat = column.flatten() if rows else pa.array([], pa.float32())
    values = flat.to_numpy(zero_copy_only=False)
    width = num_features if num_features is not None else (len(values) // rows if rows else 0)
    if rows and len(values) != rows * width:
        raise DataError(f"shard files {list(files)} hold feature vectors of uneven length "
                        f"({len(values)} values for {rows} rows x {width} features); re-run `shardline etl`")
    with warnings.catch_warnings():
        # Arrow buffers are read-only; batches are gathered with index_select (a copy), never written in place.
        warnings.simplefilter("ignore", UserWarning)
        features = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, width))
    label_array = table.column(label_field).combine_chunks().to_numpy(zero_copy_only=False)
    labels = torch.from_numpy(np.ascontiguousarray(label_array))
    if labels.dtype == torch.float64:
        labels = labels.to(torch.float32)
    return features, labels
