import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import build
from pipeline.errors import DataError
from pipeline.etl import run_etl
from pipeline.etl.split import SPLIT_COLUMN, assign_split
from pipeline.data import read_tensors

pytestmark = pytest.mark.lts  # also run on the LTS stack


def _config(tmp_path, **data):
    return build({"name": "t", "workdir": str(tmp_path / "work"), "parallelism": {"data": 2},
                  "data": {"source": "parquet", "path": str(tmp_path / "in"), "id_column": "id", **data}})


def _write_input(tmp_path, rows=200, seed=0, extra=None):
    rng = np.random.default_rng(seed)
    columns = {"id": np.arange(rows), "f1": rng.normal(5, 2, rows), "f2": rng.normal(-3, 0.5, rows),
               "label": np.where(rng.random(rows) > 0.5, "cat", "dog")}
    columns.update(extra or {})
    (tmp_path / "in").mkdir(exist_ok=True)
    pq.write_table(pa.table(columns), tmp_path / "in" / "part-0.parquet")
    return columns


def test_split_is_deterministic_and_independent_of_partitioning(spark):
    from pipeline.config.schema import SplitConfig

    df = spark.range(0, 2000).withColumnRenamed("id", "rid")
    split = SplitConfig(train=0.6, validation=0.2, test=0.2, seed=7)
    a = {r.rid: r[SPLIT_COLUMN] for r in assign_split(df.repartition(5), ["rid"], split).collect()}
    b = {r.rid: r[SPLIT_COLUMN] for r in assign_split(df.coalesce(1), ["rid"], split).collect()}
    assert a == b
    counts = {name: sum(1 for v in a.values() if v == name) for name in ("train", "validation", "test")}
    assert 1100 < counts["train"] < 1300 and 300 < counts["validation"] < 500 and 300 < counts["test"] < 500
    c = {r.rid: r[SPLIT_COLUMN] for r in assign_split(df, ["rid"], SplitConfig(train=0.6, validation=0.2,
                                                                                    test=0.2, seed=8)).collect()}
    assert c != a  # the seed matters


def test_statistics_come_from_the_train_split_only(spark, tmp_path):
    columns = _write_input(tmp_path)
    cfg = _config(tmp_path)
    manifest = run_etl(spark, cfg)
    splits = {r.id: r[SPLIT_COLUMN] for r in
              assign_split(spark.read.parquet(str(tmp_path / "in")), ["id"], cfg.data.split).collect()}
    train = np.array([splits[i] == "train" for i in columns["id"]])
    assert 0 < train.sum() < len(train)
    expected_mean = [columns["f1"][train].mean(), columns["f2"][train].mean()]
    expected_std = [columns["f1"][train].std(), columns["f2"][train].std()]
    assert np.allclose(manifest.means, expected_mean)
    assert np.allclose(manifest.stds, expected_std)
    assert not np.allclose(manifest.means, [columns["f1"].mean(), columns["f2"].mean()], atol=1e-9)
    # the shards hold standardized train features: mean ~0, std ~1 over all train shards
    x = np.concatenate([read_tensors(manifest.files("train", r))[0]["numeric"].numpy() for r in range(2)])
    assert np.allclose(x.mean(axis=0), 0, atol=1e-5) and np.allclose(x.std(axis=0), 1, atol=1e-4)
    assert manifest.label_mapping == ("cat", "dog")
    assert manifest.feature_columns == ("f1", "f2")
    assert manifest.split("train").rows + manifest.split("validation").rows + manifest.split("test").rows == 200


def test_invalid_rows_are_dropped_and_counted(spark, tmp_path):
    f1 = np.random.default_rng(1).normal(size=100)
    f1[[3, 10, 20]] = [np.nan, np.inf, -np.inf]
    _write_input(tmp_path, rows=100, extra={"f1": f1})
    manifest = run_etl(spark, _config(tmp_path))
    assert manifest.etl_report["invalid_rows"] == 3
    assert manifest.etl_report["invalid_by_column"] == {"f1": 3}
    assert sum(s.rows for s in manifest.splits.values()) == 97


def test_invalid_rows_rejected_when_configured(spark, tmp_path):
    f2 = np.random.default_rng(1).normal(size=100)
    f2[[5, 6]] = np.nan
    _write_input(tmp_path, rows=100, extra={"f2": f2})
    with pytest.raises(DataError, match=r"2 of 100 rows.*f2.*data.invalid_rows=drop"):
        run_etl(spark, _config(tmp_path, invalid_rows="reject"))


def test_csv_with_non_numeric_strings_is_reported(spark, tmp_path):
    csv = tmp_path / "in.csv"
    lines = ["id,f1,f2,label"] + [f"{i},{i * 0.5},{'oops' if i in (4, 9) else i},{i % 3}" for i in range(60)]
    csv.write_text("\n".join(lines) + "\n")
    cfg = build({"name": "csv", "workdir": str(tmp_path / "work"), "parallelism": {"data": 2},
                 "train": {"batch_size": 8},
                 "data": {"source": "csv", "path": str(csv), "id_column": "id", "invalid_rows": "reject"}})
    with pytest.raises(DataError, match=r"non-numeric: \{'f2': 2\}"):
        run_etl(spark, cfg)
    manifest = run_etl(spark, cfg.model_copy(update={"data": cfg.data.model_copy(update={"invalid_rows": "drop"})}))
    assert manifest.etl_report["non_numeric"] == {"f2": 2}
    assert manifest.label_mapping == ("0", "1", "2")


def test_missing_column_is_a_clear_error(spark, tmp_path):
    _write_input(tmp_path)
    with pytest.raises(DataError, match=r"\['nope'\].*not in the input"):
        run_etl(spark, _config(tmp_path, features=["f1", "nope"]))
    with pytest.raises(DataError, match="data.path"):
        run_etl(spark, _config(tmp_path, path=str(tmp_path / "absent")))


def test_manifest_is_json_with_counts(spark, tmp_path):
    _write_input(tmp_path)
    manifest = run_etl(spark, _config(tmp_path))
    data = json.loads((tmp_path / "work" / "shards" / "t" / "manifest.json").read_text())
    assert data["fingerprint"] == manifest.fingerprint and data["fingerprint"].startswith("sha256:")
    assert sum(s["rows"] for s in data["splits"]["train"]["shards"]) == data["splits"]["train"]["rows"]


def test_a_table_or_view_is_a_source(spark, tmp_path):
    _write_input(tmp_path, rows=80)
    spark.read.parquet(str(tmp_path / "in")).createOrReplaceTempView("shardline_etl_table_source")
    cfg = build({"name": "from_table", "workdir": str(tmp_path / "work"), "parallelism": {"data": 2},
                 "train": {"batch_size": 8},
                 "data": {"source": "table", "path": "shardline_etl_table_source", "id_column": "id"}})
    manifest = run_etl(spark, cfg)
    assert sum(split.rows for split in manifest.splits.values()) == 80
    missing = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": "no_such_table"})})
    with pytest.raises(DataError, match=r"'no_such_table' names no table or view \(data.source=table\)"):
        run_etl(spark, missing)
