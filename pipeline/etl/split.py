"""Deterministic train/validation/test assignment from a hash of each row's id, never from row order."""
from __future__ import annotations

from typing import Sequence

from pipeline.config.schema import SplitConfig

SPLIT_COLUMN = "__split"
_BUCKETS = 1_000_000


def assign_split(df, id_columns: Sequence[str], split: SplitConfig):
    """Add SPLIT_COLUMN: the same id and seed always land in the same split, on any cluster and run."""
    from pyspark.sql import functions as F

    bucket = F.pmod(F.xxhash64(F.lit(split.seed), *[F.col(c) for c in id_columns]), F.lit(_BUCKETS)) / _BUCKETS
    train_end = split.train
    validation_end = split.train + split.validation
    return df.withColumn(
        SPLIT_COLUMN,
        F.when(bucket < train_end, "train").when(bucket < validation_end, "validation").otherwise("test"),
    )
