"""Vocabularies counted, ranked and applied in Spark (pipeline/etl/vocab.py) give exactly the ids the served
model's udfs/transforms computes from the raw rows: nulls, values never seen or under min_count, integer
categoricals, ties in counts, max_vocab edges; and the same vocabularies as the Python profile's counting."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import read_tensors
from pipeline.errors import DataError
from pipeline.etl import run_etl
from tests.pipeline.typed_data import png, typed_config

ROWS = 400
FEATURES = [
    {"name": "amount", "type": "numeric"},  # not imputed: rows with a missing amount are invalid, not counted
    {"name": "city", "type": "categorical", "min_count": 3},
    {"name": "shop", "type": "categorical", "min_count": 2},  # an integer column
    {"name": "vec", "type": "vector", "length": 2},  # carries the source row index
]


def _source(path, rows=ROWS) -> pa.Table:
    rng = np.random.default_rng(7)
    amount = [None if i % 9 == 0 else float(v) for i, v in enumerate(rng.normal(size=rows))]
    # Ties: city names repeat in blocks of equal counts; singletons and a rare tail fall under min_count.
    city = [None if i % 17 == 0 else f"c{int(v)}" for i, v in enumerate(rng.zipf(1.3, rows) % 40)]
    city[5], city[6] = "only-once", "zz-rare"
    shop = [None if i % 11 == 0 else int(v) * 5 - 20 for i, v in enumerate(rng.integers(0, 12, rows))]
    shop[5] = 999  # once: under min_count, out of the vocabulary
    table = pa.table({"id": np.arange(rows), "amount": pa.array(amount, pa.float64()), "city": pa.array(city),
                      "shop": pa.array(shop, pa.int64()), "vec": pa.array([[float(i), 0.0] for i in range(rows)], pa.list_(pa.float64())),
                      "img": pa.array([png(100 * (i % 2)) for i in range(rows)], pa.binary()),
                      "label": rng.integers(0, 2, rows)})
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path / "part-0.parquet")
    return table


def _rows_by_split(manifest):
    """{split: (source row indices, {feature: ids})} read back from the shards."""
    out = {}
    for split in ("train", "validation", "test"):
        inputs, _ = read_tensors(manifest.files(split), features=manifest.feature_set)
        out[split] = (inputs["vec"][:, 0].numpy().astype(np.int64),
                      {name: inputs[name].numpy() for name in ("city", "shop")})
    return out


def _reference_vocab(values, min_count: int) -> list[str]:
    counts = Counter(str(v) for v in values if v is not None)
    return [v for v, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_count]


def test_spark_ids_equal_the_served_transform_on_the_raw_rows(spark, conf_dir, tmp_path):
    from udfs.transforms import OOV_ID, Transform

    raw = _source(tmp_path / "src")
    manifest = run_etl(spark, typed_config(conf_dir, tmp_path, str(tmp_path / "src"), FEATURES))
    rows = _rows_by_split(manifest)
    train_rows = rows["train"][0]
    # Only valid train rows count (a missing amount makes a row invalid: it is in no split).
    assert not any(raw.column("amount")[int(i)].as_py() is None for s in rows.values() for i in s[0])
    for name, min_count in (("city", 3), ("shop", 2)):
        vocab = manifest.vocabulary(name).to_pylist()
        assert vocab == _reference_vocab(raw.column(name).take(pa.array(train_rows)).to_pylist(), min_count)
    assert "only-once" not in manifest.vocabulary("city").to_pylist() and "999" not in manifest.vocabulary("shop").to_pylist()
    transform = Transform([dict(f) for f in manifest.features], manifest.vocabularies())
    seen_ids = {"city": set(), "shop": set()}
    for split, (index, ids) in rows.items():
        expected, _, _, _ = transform.apply(raw.take(pa.array(index)))
        for name in ("city", "shop"):
            assert ids[name].tolist() == expected[name].tolist(), (split, name)
            seen_ids[name].update(ids[name].tolist())
    assert {0, OOV_ID} <= seen_ids["city"] and {0, OOV_ID} <= seen_ids["shop"]  # nulls and OOV both occur

    # The same input through the Python profile's counting (an image feature makes row validity
    # undecidable in SQL): the same vocabularies.
    python_path = run_etl(spark, typed_config(conf_dir, tmp_path / "py", str(tmp_path / "src"), FEATURES + [
        {"name": "img", "type": "image", "height": 2, "width": 2, "channels": 1}], name="python-path"))
    for name in ("city", "shop"):
        assert python_path.vocabulary(name).to_pylist() == manifest.vocabulary(name).to_pylist()


def test_over_max_vocab_fails_naming_hash_buckets(spark, conf_dir, tmp_path):
    raw = _source(tmp_path / "src", rows=200)
    with pytest.raises(DataError, match=r"'shop' has more than max_vocab=3.*hash_buckets"):
        run_etl(spark, typed_config(conf_dir, tmp_path, str(tmp_path / "src"),
                                    [dict(f, max_vocab=3) if f["name"] == "shop" else f for f in FEATURES]))
    assert len(set(raw.column("shop").drop_null().to_pylist())) > 3


def test_ranking_ties_min_count_and_max_vocab_edges(spark):
    from pyspark.sql import functions as F

    from pipeline.etl.split import SPLIT_COLUMN
    from pipeline.etl.vocab import map_to_ids, ranked_vocabularies, value_counts

    values = ["b", "a", "c", "a", "b", "c", "d", "e", "e", None, "d", "f"]  # a, b, c, d, e twice: a tie of 5
    splits = ["train"] * 11 + ["test"]
    df = spark.createDataFrame([(v, s, i) for i, (v, s) in enumerate(zip(values, splits))],
                               f"v string, {SPLIT_COLUMN} string, i long")
    counts = value_counts(df, {0: "v"}, F.col("i") != 7)  # row 7 ("e") invalid: e counted once
    vocab, distinct = ranked_vocabularies(counts, {0: (2, 4)})
    assert vocab[0].to_pylist() == ["a", "b", "c", "d"] and distinct[0] == 5  # ties by value; f is test-only
    vocab, _ = ranked_vocabularies(value_counts(df, {0: "v"}, F.lit(True)), {0: (2, 4)})
    assert vocab[0].to_pylist() == ["a", "b", "c", "d", "e"]  # max_vocab + 1: over, fit_features says so
    vocab, _ = ranked_vocabularies(value_counts(df, {0: "v"}, F.lit(True)), {0: (3, 4)})
    assert vocab[0].to_pylist() == []  # nothing reaches min_count
    mapped, frame = map_to_ids(spark, df, {"v": pa.array(["b", "a"])})
    try:
        got = [r["v"] for r in mapped.orderBy("i").collect()]
    finally:
        frame.unpersist()
    assert got == [2, 3, 1, 3, 2, 1, 1, 1, 1, 0, 1, 1]
