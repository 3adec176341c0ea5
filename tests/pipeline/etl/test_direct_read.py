"""pipeline/etl/direct_read.py: pass 1 of the typed ETL reading a Parquet source with pyarrow writes the very
shard set (rows, order, ids, statistics, vocabularies) the Spark path writes, whether Spark splits one file
over several tasks or packs several files into one; sources it cannot read as Spark does keep the Spark path
and say why."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.etl.typed as typed
from pipeline.etl import run_etl
from pipeline.etl.direct_read import direct_source
from pipeline.etl.split import SPLIT_COLUMN
from pipeline.etl.typed import cast_columns
from pipeline.config.features import as_entries
from pipeline.shards.manifest import load_manifest
from tests.pipeline.typed_data import typed_config

pytestmark = pytest.mark.lts  # also on the LTS stack (pyspark 4.0, pyarrow 14): the plan and pyarrow calls differ

ROWS = 900
FEATURES = [
    {"name": "n_int", "type": "numeric", "impute": "mean", "missing_flag": True},  # int32 with nulls
    {"name": "n_bool", "type": "numeric"},
    {"name": "n_f32", "type": "numeric", "standardize": False},
    {"name": "c_str", "type": "categorical", "min_count": 2},
    {"name": "c_i16", "type": "categorical"},
    {"name": "c_bool", "type": "categorical"},
    {"name": "c_whole", "type": "categorical"},  # doubles holding whole numbers: one category per integer
    {"name": "c_hash", "type": "categorical", "hash_buckets": 32},
    {"name": "vec", "type": "vector", "length": 2},  # float32 lists
]


def _source(path, files=3) -> str:
    rng = np.random.default_rng(5)
    i = np.arange(ROWS)
    table = pa.table({
        "id": i, "n_int": pa.array([None if k % 9 == 0 else int(v) for k, v in enumerate(rng.integers(-50, 50, ROWS))],
                                   pa.int32()),
        "n_bool": pa.array(i % 3 == 0), "n_f32": pa.array(rng.normal(size=ROWS), pa.float32()),
        "c_str": pa.array([None if k % 11 == 0 else f"s{int(v)}" for k, v in enumerate(rng.zipf(1.3, ROWS) % 40)]),
        "c_i16": pa.array(rng.integers(-4, 6, ROWS), pa.int16()), "c_bool": pa.array(i % 4 == 1),
        "c_whole": pa.array((i % 6).astype(np.float64)), "c_hash": pa.array([f"h{k % 57}" for k in i]),
        "vec": pa.array([[float(k), -1.0] for k in i], pa.list_(pa.float32())),
        "label": rng.integers(0, 2, ROWS), "unused": pa.array([f"x{k}" for k in i])})
    path.mkdir(parents=True)
    step = ROWS // files
    for k in range(files):
        pq.write_table(table.slice(k * step, step), path / f"part-{k}.parquet", row_group_size=70)
    return str(path)


def _shards(manifest) -> dict:
    out = {}
    for split in ("train", "validation", "test"):
        out[split] = pa.concat_tables([pq.read_table(f) for f in manifest.files(split)]).to_pydict()
    return out


@pytest.fixture
def partition_bytes(spark):
    key = "spark.sql.files.maxPartitionBytes"
    old = spark.conf.get(key)
    yield lambda value: spark.conf.set(key, value)
    spark.conf.set(key, old)


@pytest.mark.parametrize("max_partition_bytes", ["4k", "64m"], ids=["a file over several tasks", "files packed"])
def test_the_direct_read_writes_the_shard_set_the_spark_path_writes(spark, conf_dir, tmp_path, monkeypatch,
                                                                 partition_bytes, caplog, max_partition_bytes):
    partition_bytes(max_partition_bytes)
    source = _source(tmp_path / "src")
    if max_partition_bytes == "4k":
        assert spark.read.parquet(source).rdd.getNumPartitions() > 3
    else:
        assert spark.read.parquet(source).rdd.getNumPartitions() < 3
    with caplog.at_level(logging.INFO, logger="pipeline.etl.direct_read"):
        direct = run_etl(spark, typed_config(conf_dir, tmp_path / "direct", source, FEATURES))
    assert "reads 10 columns of the Parquet source with pyarrow" in caplog.text
    monkeypatch.setattr(typed, "direct_source", lambda *a, **k: None)
    through_spark = run_etl(spark, typed_config(conf_dir, tmp_path / "spark", source, FEATURES))
    assert [f.to_dict() for f in direct.feature_set] == [f.to_dict() for f in through_spark.feature_set]
    for f in direct.feature_set:
        if f.vocabulary:
            assert direct.vocabulary(f.name).to_pylist() == through_spark.vocabulary(f.name).to_pylist()
    assert direct.etl_report["split_rows"] == through_spark.etl_report["split_rows"]
    assert _shards(direct) == _shards(through_spark)
    assert load_manifest(direct.root).splits["train"].rows > 0


def _plan(spark, df, features, id_column="id", label="label"):
    from pipeline.config.schema import SplitConfig

    from pydantic import TypeAdapter

    from pipeline.config.features import FeatureEntry

    entries = as_entries([TypeAdapter(FeatureEntry).validate_python(f) for f in features])

    data = SimpleNamespace(label=label, task="classification")  # what cast_columns reads of data
    selected = df.select(*dict.fromkeys(([id_column] if id_column else []) + [e.name for e in entries] + [label]))
    cast, _ = cast_columns(selected, entries, data)
    return direct_source(selected, cast, [e.name for e in entries] + [label], id_column, SplitConfig())


def test_sources_it_cannot_read_as_spark_does_keep_the_spark_path_and_say_why(spark, tmp_path, caplog):
    source = _source(tmp_path / "src")
    df = spark.read.parquet(source)
    plan = _plan(spark, df, FEATURES[:4])
    assert plan is not None and [n for n, _ in plan.columns] == ["n_int", "n_bool", "n_f32", "c_str", "label"]
    assert plan.frame.columns == ["__file", "__row", SPLIT_COLUMN]
    text = spark.createDataFrame([(1, "3.5", 0), (2, "x", 1)], "id long, s string, label long")
    text.write.parquet(str(tmp_path / "text"))
    pq.write_table(pa.table({"id": [1, 2], "c": ["a", "b"], "label": [0, 1]}), tmp_path / "part.parquet")
    (tmp_path / "by_day" / "day=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1, 2], "c": ["a", "b"], "label": [0, 1]}), tmp_path / "by_day" / "day=1" / "p.parquet")
    df.select("id", "c_str", "label").write.csv(str(tmp_path / "csv"), header=True)
    cases = [
        (df.where("id > 3"), FEATURES[3:4], "id", "the source is a query"),
        (df.selectExpr("id", "upper(c_str) AS c_str", "label"), FEATURES[3:4], "id", "the source is a query"),
        (df, FEATURES[3:4], None, "no data.id_column"),
        (spark.read.parquet(str(tmp_path / "text")), [{"name": "s", "type": "numeric"}], "id",
         "columns ['s (string -> double)'] need Spark's own conversion"),
        (spark.read.parquet(str(tmp_path / "by_day")), [{"name": "day", "type": "categorical"}], "id",
         "come from partition directories"),
        (spark.read.csv(str(tmp_path / "csv"), header=True), FEATURES[3:4], "id", "not Parquet"),
    ]
    for frame, features, id_column, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipeline.etl.direct_read"):
            assert _plan(spark, frame, features, id_column) is None, reason
        assert reason in caplog.text and "reads the source through Spark" in caplog.text
