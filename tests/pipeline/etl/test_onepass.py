"""The one-pass typed ETL (pipeline/etl/onepass.py, udfs/typed_encode.py, udfs/typed_remap.py): strings read
once as partition-local ids, mapped to the fitted vocabulary's ids afterwards. Across several partitions and
many small Arrow batches (local ids offset per batch, a value repeating across batches and partitions) the
shards hold exactly udfs/transforms.Transform.apply's ids for the raw rows; the scratch files are gone after
success and after a failure, which leaves the previous shard set intact."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config.workdir import Workdir
from pipeline.data import read_tensors
from pipeline.errors import DataError
from pipeline.etl import run_etl
from pipeline.shards.manifest import load_manifest
from tests.pipeline.typed_data import typed_config

ROWS = 300
FEATURES = [
    {"name": "amount", "type": "numeric", "impute": "mean", "missing_flag": True},
    {"name": "score", "type": "numeric"},  # not imputed: a missing score makes the row invalid
    {"name": "city", "type": "categorical", "min_count": 2},
    {"name": "shop", "type": "categorical", "min_count": 1},  # integers
    {"name": "tag", "type": "categorical", "hash_buckets": 16},
    {"name": "vec", "type": "vector", "length": 1},  # the source row index
]


def _source(path) -> pa.Table:
    rng = np.random.default_rng(3)
    amount = [None if i % 7 == 0 else float(v) for i, v in enumerate(rng.normal(size=ROWS))]
    score = [None if i % 23 == 0 else float(v) for i, v in enumerate(rng.normal(size=ROWS))]
    city = [None if i % 13 == 0 else f"c{int(v)}" for i, v in enumerate(rng.zipf(1.4, ROWS) % 25)]
    shop = [None if i % 11 == 0 else int(v) for i, v in enumerate(rng.integers(-3, 9, ROWS))]
    tag = [None if i % 5 == 0 else f"t{int(v)}" for i, v in enumerate(rng.integers(0, 40, ROWS))]
    table = pa.table({"id": np.arange(ROWS), "amount": pa.array(amount, pa.float64()),
                      "score": pa.array(score, pa.float64()), "city": pa.array(city),
                      "shop": pa.array(shop, pa.int64()),
                      "tag": pa.array(tag), "vec": pa.array([[float(i)] for i in range(ROWS)], pa.list_(pa.float64())),
                      "label": rng.integers(0, 2, ROWS)})
    path.mkdir(parents=True, exist_ok=True)
    for k, start in enumerate(range(0, ROWS, 100)):  # three files: three Spark partitions
        pq.write_table(table.slice(start, 100), path / f"part-{k}.parquet")
    return table


@pytest.fixture
def small_batches(spark):
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    old = spark.conf.get(key)
    spark.conf.set(key, "17")
    try:
        yield
    finally:
        spark.conf.set(key, old)


def _scratch(cfg) -> list:
    shards = Workdir.of(cfg).shards
    return sorted(p.name for p in shards.parent.glob(f".{shards.name}.encode-*"))


def test_ids_equal_the_served_transform_across_partitions_and_batches(spark, conf_dir, tmp_path, small_batches):
    from udfs.transforms import Transform

    raw = _source(tmp_path / "src")
    cfg = typed_config(conf_dir, tmp_path, str(tmp_path / "src"), FEATURES)
    manifest = run_etl(spark, cfg)
    assert _scratch(cfg) == []
    transform = Transform([dict(f) for f in manifest.features], manifest.vocabularies())
    train_index, written = None, 0
    for split in ("train", "validation", "test"):
        inputs, _ = read_tensors(manifest.files(split), features=manifest.feature_set)
        index = inputs["vec"][:, 0].numpy().astype(np.int64)
        written += len(index)
        train_index = index if split == "train" else train_index
        expected, valid, _, _ = transform.apply(raw.take(pa.array(index)))
        assert valid.all()
        for name in ("city", "shop", "tag"):
            assert inputs[name].numpy().tolist() == expected[name].tolist(), (split, name)
        assert np.allclose(inputs["numeric"].numpy(), expected["numeric"])
    assert written == ROWS - sum(v is None for v in raw.column("score").to_pylist())
    assert manifest.etl_report["invalid_by_column"] == {"score": ROWS - written}
    for name, min_count in (("city", 2), ("shop", 1)):
        counts = Counter(str(v) for v in raw.column(name).take(pa.array(train_index)).to_pylist() if v is not None)
        reference = [v for v, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_count]
        assert manifest.vocabulary(name).to_pylist() == reference
        assert next(f for f in manifest.feature_set if f.name == name).distinct_values == len(counts)


def test_a_failure_after_the_encode_pass_removes_its_files_and_keeps_the_shard_set(spark, conf_dir, tmp_path):
    _source(tmp_path / "src")
    cfg = typed_config(conf_dir, tmp_path, str(tmp_path / "src"), FEATURES)
    manifest = run_etl(spark, cfg)
    tight = typed_config(conf_dir, tmp_path, str(tmp_path / "src"),
                         [dict(f, max_vocab=2) if f["name"] == "shop" else f for f in FEATURES])
    with pytest.raises(DataError, match=r"'shop' has more than max_vocab=2"):
        run_etl(spark, tight)
    assert _scratch(tight) == []
    assert load_manifest(manifest.root).fingerprint == manifest.fingerprint


def test_local_dictionary_offsets_batches_and_counts_only_train_rows():
    from udfs.typed_encode import LOCAL_NULL, _LocalDictionary

    local = _LocalDictionary()
    first = local.encode(pa.array(["a", None, "b", "a"]), np.array([True, True, False, True]))
    second = local.encode(pa.array([3, 3, None], pa.int64()), np.array([False, True, True]))
    third = local.encode(pa.array(["b", "3", "a"]), np.array([True, True, False]))
    values = pa.concat_arrays(local.values).to_pylist()
    assert values == ["a", "b", "3", "b", "3", "a"] and first.tolist() == [0, LOCAL_NULL, 1, 0]
    assert second.tolist() == [2, 2, LOCAL_NULL] and third.tolist() == [3, 4, 5]
    assert np.concatenate(local.counts).tolist() == [2, 0, 1, 1, 1, 0]
    distinct, counts, remap = local.unique()  # repeats across batches: one entry, counts summed
    assert distinct.to_pylist() == ["a", "b", "3"] and counts.tolist() == [2, 1, 2]
    assert remap.tolist() == [0, 1, 2, 1, 2, 0]


def test_summed_counts_adds_partitions_and_drops_values_seen_outside_train(tmp_path):
    from pipeline.etl.onepass import summed_counts
    from udfs.typed_encode import DICT_SCHEMA, write_arrow

    paths = []
    for k, (features, values, n) in enumerate([([0, 0, 1], ["x", "y", "x"], [2, 0, 1]),
                                               ([0, 0], ["x", "x"], [3, 1])]):
        paths.append(str(tmp_path / f"d{k}.arrow"))
        write_arrow(paths[-1], pa.table([pa.array(features, pa.int32()), pa.array(values), pa.array(n, pa.int64())],
                                        schema=DICT_SCHEMA))
    summed = summed_counts(paths).sort_by([("feature", "ascending"), ("value", "ascending")])
    assert summed.to_pylist() == [{"feature": 0, "value": "x", "n": 6}, {"feature": 1, "value": "x", "n": 1}]
    assert summed_counts([]).num_rows == 0


def test_pass_one_widens_arrow_batches_only_for_numeric_and_categorical_rows_at_sparks_default(spark):
    from types import SimpleNamespace

    from pipeline.etl.onepass import BATCH_KEY, WIDE_BATCH_ROWS, batch_rows

    flat = [SimpleNamespace(type="numeric"), SimpleNamespace(type="categorical")]
    wide = [SimpleNamespace(type=f["type"]) for f in FEATURES]  # a vector feature: the session's size is kept
    old = spark.conf.get(BATCH_KEY, None)
    try:
        spark.conf.set(BATCH_KEY, "10000")
        with batch_rows(spark, flat):
            assert spark.conf.get(BATCH_KEY) == str(WIDE_BATCH_ROWS)
        assert spark.conf.get(BATCH_KEY) == "10000"
        with batch_rows(spark, wide):
            assert spark.conf.get(BATCH_KEY) == "10000"
        spark.conf.set(BATCH_KEY, "17")  # a session's own setting wins
        with batch_rows(spark, flat):
            assert spark.conf.get(BATCH_KEY) == "17"
    finally:
        if old is None:
            spark.conf.unset(BATCH_KEY)
        else:
            spark.conf.set(BATCH_KEY, old)
