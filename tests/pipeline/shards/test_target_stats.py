"""The train split's target moments, read from shard files: equal to numpy's over all train rows (files
and row batches merged), a constant target scaled by 1, an empty or non-finite split an error."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest, Shard, ShardFile, SplitShards
from pipeline.shards.target_stats import target_moments


def shard_set(root, parts: list[np.ndarray]) -> Manifest:
    shards = []
    for i, y in enumerate(parts):
        path = f"train/part-{i}.parquet"
        (root / "train").mkdir(exist_ok=True)
        pq.write_table(pa.table({"label": pa.array(y, pa.float64())}), root / path, row_group_size=7)
        shards.append(Shard(i, len(y), (ShardFile(path, len(y), 0),)))
    rows = sum(len(y) for y in parts)
    return Manifest(name="t", task="regression", feature_columns=("x",), label_column="target", label_mapping=None,
                    standardized=True, means=(0.0,), stds=(1.0,), splits={"train": SplitShards(rows, tuple(shards))},
                    fingerprint="sha256:0", root=str(root))


def test_moments_over_files_and_batches_equal_numpys(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.normal(3000, 400, 50), rng.normal(3500, 100, 23), np.array([10_000.0])]
    mean, std = target_moments(shard_set(tmp_path, parts))
    everything = np.concatenate(parts)
    assert mean == pytest.approx(everything.mean(), rel=1e-12)
    assert std == pytest.approx(everything.std(), rel=1e-12)


def test_a_constant_target_is_scaled_by_one(tmp_path):
    assert target_moments(shard_set(tmp_path, [np.full(5, 42.0)])) == (42.0, 1.0)


def test_an_empty_or_non_finite_split_is_an_error_naming_the_target(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with pytest.raises(DataError, match="no rows"):
        target_moments(shard_set(tmp_path / "a", [np.array([])]))
    with pytest.raises(DataError, match="'target'.*non-finite"):
        target_moments(shard_set(tmp_path / "b", [np.array([1.0, np.inf])]))
