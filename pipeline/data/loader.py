"""Small shard file sets read whole into tensors (validation split, input examples, tests).

Training reads through the streaming loader (stream.py); this is for data that fits in memory. Row
groups are read with the loader's own column reader (arrow_read.py), so a batch here has exactly the
training batch's keys, shapes and dtypes; arrays are handed to torch without a copy where Arrow allows.
"""
from __future__ import annotations

import logging
import warnings
from typing import Sequence

log = logging.getLogger(__name__)


def read_tensors(files: Sequence[str], features_field: str = "features", label_field: str = "label",
                 num_features: int | None = None, features=None, rows: tuple[int, int] | None = None):
    """Read Parquet shard files into (inputs dict of tensors, labels) — see pipeline.config.feature_spec.

    ``rows=(start, stop)``: only those rows of the files read one after another (each rank's part of the
    validation split); row groups wholly outside them are not read at all."""
    import numpy as np
    import pyarrow as pa
    import torch

    from pipeline.data.arrow_read import read_row_group
    from pipeline.errors import DataError, shard_read_error
    from pipeline.storage import open_parquet

    if not files:
        raise DataError("no shard files to read for this rank")
    start, stop = rows if rows is not None else (0, None)
    parts, labels = [], []
    offset = 0  # rows of the files before this row group
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
            x, y = read_row_group(parquet, path, index, features_field, label_field, num_features, features)
            if (lo, hi) != (0, count):
                x, y = {key: value[lo:hi] for key, value in x.items()}, y[lo:hi]
            parts.append(x)
            labels.append(y)
    if not labels:
        what = "hold no rows" if rows is None else f"hold {offset} rows, none of rows {start}..{stop}"
        raise DataError(f"the {len(files)} shard file(s) {what}; re-run `shardline etl`")
    keys = parts[0].keys() if parts else ()
    with warnings.catch_warnings():
        # Arrow buffers are read-only; batches are gathered with index_select (a copy), never written in place.
        warnings.simplefilter("ignore", UserWarning)
        inputs = {key: torch.from_numpy(np.ascontiguousarray(
            parts[0][key] if len(parts) == 1 else np.concatenate([p[key] for p in parts]))) for key in keys}
        label_array = labels[0] if len(labels) == 1 else np.concatenate(labels)
        label_tensor = torch.from_numpy(np.ascontiguousarray(label_array))
    return inputs, label_tensor
