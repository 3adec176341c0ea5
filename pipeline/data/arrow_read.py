"""One Parquet row group -> (features float32 [rows, width], labels) numpy arrays, zero-copy where Arrow allows.

The features column is a list<float> (what Spark writes) or fixed_size_list<float>: either way its
flattened child is one contiguous float32 buffer, viewed as a (rows, width) array without a copy.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)


def _matrix(column, path: str, index: int, width: Optional[int], field: str):
    import numpy as np
    import pyarrow as pa

    from pipeline.errors import DataError

    chunks = column.chunks
    parts = []
    rows = 0
    for chunk in chunks:
        rows += len(chunk)
        if chunk.null_count:
            raise DataError(f"{path} row group {index}: column {field!r} has {chunk.null_count} null vectors; "
                            "re-run `shardline etl`")
        values = chunk.flatten()  # honours slice offsets; zero-copy on unsliced data
        if values.type != pa.float32():
            values = values.cast(pa.float32())
        parts.append(values.to_numpy(zero_copy_only=values.null_count == 0))
    flat = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.float32)
    width = width if width is not None else (len(flat) // rows if rows else 0)
    if len(flat) != rows * width:
        raise DataError(f"{path} row group {index}: column {field!r} holds {len(flat)} values for {rows} rows x "
                        f"{width} features (vectors of uneven length); re-run `shardline etl`")
    return flat.reshape(rows, width)


def read_row_group(parquet_file, path: str, index: int, features_field: Optional[str], label_field: Optional[str],
                   width: Optional[int]):
    """(features, labels) of row group `index`; labels int64 for classes, float32 for regression.

    A field given as None is not read (a pipeline stage that needs only features, or only labels):
    its array is then an empty-width matrix / zeros of the row count, so batching still lines up."""
    import numpy as np
    import pyarrow as pa

    from pipeline.errors import DataError, shard_read_error

    columns = [f for f in (features_field, label_field) if f is not None]
    try:
        table = parquet_file.read_row_group(index, columns=columns)
    except (pa.ArrowInvalid, OSError, KeyError) as exc:
        raise shard_read_error(f"cannot read row group {index} of shard file {path}: {exc}; re-run `shardline etl`",
                               exc) from None
    if features_field is None:
        features = np.empty((table.num_rows, 0), dtype=np.float32)
    else:
        features = _matrix(table.column(features_field), path, index, width, features_field)
    if label_field is None:
        return features, np.zeros(table.num_rows, dtype=np.int64)
    label_column = table.column(label_field)
    if label_column.null_count:
        raise DataError(f"{path} row group {index}: {label_column.null_count} null labels; re-run `shardline etl`")
    chunks = [c.to_numpy(zero_copy_only=False) for c in label_column.chunks]
    labels = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    if labels.dtype == np.float64:
        labels = labels.astype(np.float32)
    return features, labels
