"""One Parquet row group -> (inputs dict of numpy arrays, labels), zero-copy where Arrow allows.

The numeric block is a list<float> (what Spark writes) or fixed_size_list<float>: either way its
flattened child is one contiguous float32 buffer, viewed as a (rows, width) array without a copy; ids,
pixels and token columns are viewed the same way in their own dtypes.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)


def _matrix(column, path: str, index: int, width: Optional[int], field: str, dtype=None):
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
        target = pa.from_numpy_dtype(dtype) if dtype is not None else pa.float32()
        if values.type != target:
            values = values.cast(target)
        parts.append(values.to_numpy(zero_copy_only=values.null_count == 0))
    flat = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, dtype or np.float32)
    width = width if width is not None else (len(flat) // rows if rows else 0)
    if len(flat) != rows * width:
        raise DataError(f"{path} row group {index}: column {field!r} holds {len(flat)} values for {rows} rows x "
                        f"{width} features (vectors of uneven length); re-run `shardline etl`")
    return flat.reshape(rows, width)


def shard_columns(features, features_field: Optional[str]) -> list[str]:
    """The shard columns holding a batch's inputs: the packed numeric block and one column per other
    feature (text: its ids and its lengths). None/empty `features_field`: none (a stage that needs labels only)."""
    if not features_field:
        return []
    if features is None:
        return [features_field]
    columns = [features_field] if features.numeric else []
    for spec in features:
        if spec.type != "numeric":
            columns.append(spec.column)
            if spec.type == "text":
                columns.append(spec.column + "__len")
    return columns


def _fixed(column, path: str, index: int, field: str, shape: tuple[int, ...], dtype):
    """A (fixed-size) list column of one dtype as an [rows, *shape] array, zero-copy where Arrow allows."""
    import numpy as np

    width = int(np.prod(shape)) if shape else 1
    flat = _matrix(column, path, index, width, field, dtype=dtype)
    return flat.reshape((flat.shape[0], *shape))


def _pixels(column, path: str, index: int, field: str, shape: tuple[int, ...]):
    """Decoded images stored one fixed-size binary value per row (what Spark hands back as plain binary):
    viewed as uint8 [rows, *shape] without a per-row copy when Arrow gives one contiguous buffer."""
    import numpy as np
    import pyarrow as pa

    from pipeline.errors import DataError

    width = int(np.prod(shape))
    parts = []
    for chunk in column.chunks:
        if chunk.null_count:
            raise DataError(f"{path} row group {index}: column {field!r} has {chunk.null_count} null images; "
                            "re-run `shardline etl`")
        if not pa.types.is_fixed_size_binary(chunk.type):
            chunk = chunk.cast(pa.binary(width))  # raises unless every value holds width bytes
        data = np.frombuffer(chunk.buffers()[1], dtype=np.uint8)
        start = chunk.offset * width
        parts.append(data[start:start + len(chunk) * width])
    flat = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.uint8)
    if len(flat) != sum(len(c) for c in column.chunks) * width:
        raise DataError(f"{path} row group {index}: column {field!r} holds images of another size than "
                        f"{shape}; re-run `shardline etl`")
    return flat.reshape((-1, *shape))


def _scalars(column, path: str, index: int, field: str, dtype):
    import numpy as np

    from pipeline.errors import DataError

    if column.null_count:
        raise DataError(f"{path} row group {index}: column {field!r} has {column.null_count} nulls; re-run `shardline etl`")
    parts = [c.to_numpy(zero_copy_only=False) for c in column.chunks]
    values = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, dtype)
    return values.astype(dtype, copy=False)


def feature_arrays(table, features, features_field: str, path: str, index: int, width: Optional[int]) -> dict:
    """The batch dict's numpy arrays of one row group (see pipeline.config.feature_spec for the layout).
    Encoded images are decoded here, in the reader thread that read them."""
    import numpy as np

    from pipeline.errors import DataError

    if features is None:
        return {"numeric": _matrix(table.column(features_field), path, index, width, features_field)}
    arrays = {}
    if features.numeric:
        arrays["numeric"] = _matrix(table.column(features_field), path, index, features.numeric_width, features_field)
    for spec in features:
        if spec.type == "numeric":
            continue
        column = table.column(spec.column)
        if spec.type == "categorical":
            arrays[spec.name] = _scalars(column, path, index, spec.column, np.int64)
        elif spec.type == "vector":
            arrays[spec.name] = _fixed(column, path, index, spec.column, (spec.length,), np.float32)
        elif spec.type == "text":
            arrays[spec.name] = _fixed(column, path, index, spec.column, (spec.max_len,), np.int64)
            arrays[spec.name + "__len"] = _scalars(table.column(spec.column + "__len"), path, index,
                                                   spec.column + "__len", np.int64)
        elif spec.type == "image" and spec.storage == "encoded":
            from udfs.transforms import decode_images

            pixels, bad, error = decode_images(column.to_pylist(), spec.height, spec.width, spec.channels)
            if bad.any():
                raise DataError(f"{path} row group {index}: {int(bad.sum())} image(s) of column {spec.column!r} no "
                                f"longer decode ({error}); re-run `shardline etl`")
            arrays[spec.name] = pixels
        elif spec.type == "image":
            arrays[spec.name] = _pixels(column, path, index, spec.column, spec.shape)
        else:
            raise DataError(f"{path}: feature {spec.name!r} has unknown type {spec.type!r}; re-run `shardline etl`")
    return arrays


def read_row_group(parquet_file, path: str, index: int, features_field: Optional[str], label_field: Optional[str],
                   width: Optional[int], features=None):
    """(inputs dict, labels) of row group `index`; labels int64 for classes, float32 for regression.

    `features` (a FeatureSet) says which columns hold what; None reads the classic packed numeric block.
    A field given as None is not read (a pipeline stage that needs only features, or only labels): the
    inputs are then {} / labels zeros of the row count, so batching still lines up."""
    import numpy as np
    import pyarrow as pa

    from pipeline.errors import DataError, shard_read_error

    inputs = shard_columns(features, features_field)
    columns = inputs + ([label_field] if label_field is not None else [])
    try:
        # use_threads=False: a row group is decoded on the calling reader thread alone. The loader's own
        # reader threads (data.reader_threads) already decode row groups side by side; pyarrow's pool
        # inside each read only added hand-offs and contention (a 65k x 64 fp32 row group on 2 cores:
        # 16-17 ms single-threaded against 21-35 ms with its pool, bench/loader_bench.py).
        table = parquet_file.read_row_group(index, columns=columns, use_threads=False)
    except (pa.ArrowInvalid, OSError, KeyError) as exc:
        raise shard_read_error(f"cannot read row group {index} of shard file {path}: {exc}; re-run `shardline etl`",
                               exc) from None
    arrays = feature_arrays(table, features, features_field, path, index, width) if inputs else {}
    if label_field is None:
        return arrays, np.zeros(table.num_rows, dtype=np.int64)
    label_column = table.column(label_field)
    if label_column.null_count:
        raise DataError(f"{path} row group {index}: {label_column.null_count} null labels; re-run `shardline etl`")
    chunks = [c.to_numpy(zero_copy_only=False) for c in label_column.chunks]
    labels = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    if labels.dtype == np.float64:
        labels = labels.astype(np.float32)
    return arrays, labels
