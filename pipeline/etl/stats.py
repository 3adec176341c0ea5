"""Feature statistics, computed on the train split only so validation/test never leak into training."""
from __future__ import annotations

from typing import Sequence


def train_statistics(df, features: Sequence[str], split_column: str) -> tuple[list[float], list[float]]:
    """Per-feature mean and population std over train rows; a constant feature gets std 1 (no divide by 0)."""
    from pyspark.sql import functions as F

    train = df.where(F.col(split_column) == "train")
    aggs = []
    for i, c in enumerate(features):
        aggs += [F.mean(F.col(c)).alias(f"m{i}"), F.stddev_pop(F.col(c)).alias(f"s{i}")]
    row = train.agg(*aggs).collect()[0]
    means = [float(row[f"m{i}"]) for i in range(len(features))]
    stds = [float(row[f"s{i}"]) if row[f"s{i}"] and row[f"s{i}"] > 1e-12 else 1.0 for i in range(len(features))]
    return means, stds
