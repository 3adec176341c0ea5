"""Regression: the mean and standard deviation of the train split's targets, read from the shard files.

Why here and at train time: the ETL's statistics cover the features only, and both ETL paths (plain and
typed) write the label as a plain float column of the train shards; reading that one column back gives
the same numbers for either, for shard sets written before this existed, and needs no second profile
pass. The read streams one column in file order (deterministic, so a resumed run rebuilds the same
model spec) with Chan's parallel update of (count, mean, M2), float64 throughout.
"""
from __future__ import annotations

import logging
import math

from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest

log = logging.getLogger(__name__)

# A target this close to constant has no scale to learn; standardizing by it would blow predictions up.
_MIN_STD = 1e-12


def target_moments(manifest: Manifest, split: str = "train") -> tuple[float, float]:
    """(mean, population std) of the label column over ``split``; std 1.0 for a constant target."""
    import numpy as np
    import pyarrow.parquet as pq

    count, mean, m2 = 0, 0.0, 0.0
    for path in manifest.files(split):
        for batch in pq.ParquetFile(path).iter_batches(columns=[manifest.label_field], batch_size=1 << 16):
            y = batch.column(0).to_numpy(zero_copy_only=False).astype(np.float64)
            n = len(y)
            if n == 0:
                continue
            with np.errstate(invalid="ignore", over="ignore"):  # a NaN/Inf target is reported below
                b_mean = float(y.mean())
                b_m2 = float(np.square(y - b_mean).sum())
            total = count + n
            delta = b_mean - mean
            mean += delta * n / total
            m2 += b_m2 + delta * delta * count * n / total
            count = total
    if count == 0:
        raise DataError(f"the {split} split of {manifest.root} has no rows to standardize the target "
                        f"{manifest.label_column!r} on; re-run `shardline etl`")
    std = math.sqrt(m2 / count)
    if not (math.isfinite(mean) and math.isfinite(std)):
        raise DataError(f"the target {manifest.label_column!r} of the {split} split has non-finite values "
                        f"(mean {mean}, std {std}); check the label column")
    log.info("target %r on the %s split: mean %.6g, std %.6g (%d rows)", manifest.label_column, split, mean,
             std, count)
    return mean, std if std > _MIN_STD else 1.0
