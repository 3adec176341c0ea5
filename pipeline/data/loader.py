"""Shard file sets read row group by row group (the validation split), or whole into tensors (input
examples, tests).

Training reads through the streaming loader (stream.py), with its shuffle and read-ahead. Row groups are
read with the loader's own column reader (arrow_read.py), so a batch here has exactly the training batch's
keys, shapes and dtypes; arrays are handed to torch without a copy where Arrow allows.
"""
from __future__ import annotations

import logging
import warnings
from typing import Iterator, Sequence

log = logging.getLogger(__name__)


def read_tensors(files: Sequence[str], features_field: str = "features", label_field: str = "label",
                 num_features: int | None = None, features=None, rows: tuple[int, int] | None = None):
    """Read Parquet shard files into (inputs dict of tensors, labels) — see pipeline.config.feature_spec.

    ``rows=(start, stop)``: only those rows of the files read one after another; row groups wholly outside
    them are not read at all. Everything is held at once: for the validation split a rank streams instead
    (``row_groups``, pipeline.worker.validation.ValidationPart)."""
    import numpy as np

    parts, labels = [], []
    for x, y in row_groups(files, features_field, label_field, num_features, features, rows):
        parts.append(x)
        labels.append(y)
    keys = parts[0].keys()
    inputs = {key: parts[0][key] if len(parts) == 1 else np.concatenate([p[key] for p in parts]) for key in keys}
    return as_tensors(inputs, labels[0] if len(labels) == 1 else np.concatenate(labels))


def as_tensors(inputs: dict, labels):
    """numpy (inputs, labels) as torch tensors, without a copy where the arrays are contiguous."""
    import numpy as np
    import torch

    with warnings.catch_warnings():
        # Arrow buffers are read-only; batches are gathered with index_select (a copy), never written in place.
        warnings.simplefilter("ignore", UserWarning)
        return ({key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in inputs.items()},
                torch.from_numpy(np.ascontiguousarray(labels)))


def row_groups(files: Sequence[str], features_field: str = "features", label_field: str = "label",
               num_features: int | None = None, features=None, rows: tuple[int, int] | None = None,
               read=None) -> Iterator[tuple[dict, object]]:
    """(inputs dict of numpy arrays, labels) of each row group of ``files`` in turn, cut to ``rows``
    (see read_tensors), one at a time: the caller holds only what it keeps. ``read``: the row group
    reader (default pipeline.data.arrow_read.read_row_group, the training loader's)."""
    import pyarrow as pa

    from pipeline.data.arrow_read import read_row_group
    from pipeline.errors import DataError, shard_read_error
    from pipeline.storage import open_parquet

    read = read or read_row_group
    if not files:
        raise DataError("no shard files to read for this rank")
    start, stop = rows if rows is not None else (0, None)
    offset = 0  # rows of the files before this row group
    found = False
    for path in files:
        if stop is not None and offset >= stop:
            break
        try:
            parquet = open_parquet(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise shard_read_error(f"cannot read shard file {path}: {exc}; re-run `shardline etl`", exc) from None
        for index in range(parquet.metadata.num_row_groups):
            count = parquet.metadata.row_group(index).num_rows
            lo, hi = max(start - offset, 0), count if stop is None else min(stop - offset, count)
            offset += count
            if lo >= hi:
                continue
            x, y = read(parquet, path, index, features_field, label_field, num_features, features)
            if (lo, hi) != (0, count):
                x, y = {key: value[lo:hi] for key, value in x.items()}, y[lo:hi]
            found = True
            yield x, y
    if not found:
        what = "hold no rows" if rows is None else f"hold {offset} rows, none of rows {start}..{stop}"
        raise DataError(f"the {len(files)} shard file(s) {what}; re-run `shardline etl`")


def file_rows(files: Sequence[str]) -> int:
    """The rows of ``files``, from their footers."""
    from pipeline.storage import open_parquet

    return sum(open_parquet(path).metadata.num_rows for path in files)
