"""Vocabularies ranked from the train counts (pipeline/etl/vocab.py): the rule (count desc, value asc,
min_count, max_vocab + 1 to say "over") on ties and edges, and through the real ETL the shards hold exactly
the ids the served model's udfs/transforms computes from the raw rows: nulls, values never seen or under
min_count, integer categoricals."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import read_tensors
from pipeline.errors import DataError
from pipeline.etl import run_etl
from tests.pipeline.typed_data import typed_config

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


def test_shard_ids_equal_the_served_transform_on_the_raw_rows(spark, conf_dir, tmp_path):
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


def test_over_max_vocab_fails_naming_hash_buckets(spark, conf_dir, tmp_path):
    raw = _source(tmp_path / "src", rows=200)
    with pytest.raises(DataError, match=r"'shop' has more than max_vocab=3.*hash_buckets"):
        run_etl(spark, typed_config(conf_dir, tmp_path, str(tmp_path / "src"),
                                    [dict(f, max_vocab=3) if f["name"] == "shop" else f for f in FEATURES]))
    assert len(set(raw.column("shop").drop_null().to_pylist())) > 3


def test_ranking_ties_min_count_and_max_vocab_edges():
    from pipeline.etl.vocab import rank_counts

    counts = pa.table({"feature": pa.array([0, 0, 0, 0, 0, 0, 1, 1, 1], pa.int32()),
                       "value": ["b", "a", "é", "z", "c", "d", "7", "-3", "10"],
                       "n": pa.array([2, 2, 2, 2, 3, 1, 4, 4, 1], pa.int64())})
    vocab, distinct = rank_counts(counts, {0: (2, 5), 1: (1, 3)})
    assert vocab[0].to_pylist() == ["c", "a", "b", "z", "é"]  # ties by value (byte/code point order)
    assert vocab[1].to_pylist() == ["-3", "7", "10"] and distinct == {0: 6, 1: 3}
    assert vocab[0].to_pylist() == _reference_vocab([v for v, n in zip(counts["value"].to_pylist(),
                                                                       counts["n"].to_pylist()[:6]) for _ in range(n)], 2)
    vocab, _ = rank_counts(counts, {0: (2, 4)})
    assert len(vocab[0]) == 5  # max_vocab + 1: over, fit_features names the error
    vocab, _ = rank_counts(counts, {0: (2, 6)})
    assert len(vocab[0]) == 5  # exactly the values reaching min_count
    vocab, distinct = rank_counts(counts, {0: (4, 4), 2: (1, 10)})
    assert vocab[0].to_pylist() == [] and vocab[2].to_pylist() == [] and distinct[2] == 0


# --- the ranking in Spark (issue 47): the same vocabularies as the driver's, the driver never sums them ---

def _dict_files(tmp_path, counts: pa.Table, partitions: int) -> list[str]:
    """`counts` dealt round-robin over `partitions` `.dict` files, as pass 1 writes them (a value may be
    in several partitions, each with its part of the count)."""
    from udfs.typed_encode import DICT_SCHEMA, write_arrow

    rows = {p: [] for p in range(partitions)}
    k = 0
    for feature, value, n in zip(*(counts.column(c).to_pylist() for c in ("feature", "value", "n"))):
        share, left = divmod(n, partitions) if n > 0 else (0, 0)
        for p in range(partitions):  # every partition its share, the leftover to the next ones
            part = share + (1 if (p - k) % partitions < left else 0)
            if part or (n == 0 and p == k % partitions):  # a value seen only outside train: n = 0 somewhere
                rows[p].append((feature, value, part))
        k += 1
    paths = []
    for p, part in rows.items():
        path = str(tmp_path / f"part-{p}.dict.arrow")
        write_arrow(path, pa.table([pa.array([r[i] for r in part], t) for i, t in
                                    enumerate((pa.int32(), pa.string(), pa.int64()))], schema=DICT_SCHEMA))
        paths.append(path)
    return paths


@pytest.mark.parametrize("limits", [{0: (2, 5), 1: (1, 3)}, {0: (2, 4)}, {0: (2, 6)}, {0: (4, 4), 2: (1, 10)},
                                    {0: (1, 1), 1: (5, 3)}])
def test_spark_ranks_as_the_driver_on_ties_min_count_and_max_vocab_edges(spark, tmp_path, limits):
    from pipeline.etl.onepass import summed_counts
    from pipeline.etl.vocab import rank_counts, rank_in_spark

    counts = pa.table({"feature": pa.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], pa.int32()),
                       "value": ["b", "a", "é", "z", "c", "d", "never-in-train", "7", "-3", "10", "Z"],
                       "n": pa.array([2, 2, 2, 2, 3, 1, 0, 4, 4, 1, 4], pa.int64())})
    paths = _dict_files(tmp_path, counts, 3)
    expected = rank_counts(summed_counts(paths), limits)
    vocab, distinct = rank_in_spark(spark, paths, limits)
    assert distinct == expected[1]
    assert {i: v.to_pylist() for i, v in vocab.items()} == {i: v.to_pylist() for i, v in expected[0].items()}
    assert all(v.type == pa.string() for v in vocab.values())


def _clicks_config(conf_dir, tmp_path, c2_max_vocab=100_000):
    from pipeline.config.loader import build, deep_merge, read_yaml

    features = [{"name": "n0", "type": "numeric", "impute": "mean"},
                {"name": "c0", "type": "categorical", "min_count": 1},  # a long tail of count-1 ties
                {"name": "c1", "type": "categorical", "min_count": 2},
                {"name": "c2", "type": "categorical", "min_count": 1, "max_vocab": c2_max_vocab}]
    return build(deep_merge(read_yaml(f"{conf_dir}/base.yaml"), {
        "name": "clicks-vocab", "workdir": str(tmp_path / "work"),
        "data": {"source": "clicks", "label": "label", "id_column": "id", "features": features,
                 "clicks": {"rows": 3000, "numeric": 1, "categorical": 3, "vocab": 400, "big_vocab": 4000,
                            "partitions": 3, "seed": 5}},
        "parallelism": {"data": 2}, "train": {"batch_size": 16}}))


def _ranked_in_spark(monkeypatch):
    """Force the Spark ranking, and fail if the driver sums the dictionaries."""
    from pipeline.etl import onepass

    def refused(paths):
        raise AssertionError("the driver summed the partitions' dictionaries")

    monkeypatch.setattr(onepass, "DRIVER_RANK_MAX_ROWS", 0)
    monkeypatch.setattr(onepass, "summed_counts", refused)


def test_clicks_vocabularies_and_shard_ids_are_the_same_ranked_in_spark(spark, conf_dir, tmp_path, monkeypatch,
                                                                         caplog):
    driver = run_etl(spark, _clicks_config(conf_dir, tmp_path / "driver"))
    with monkeypatch.context() as patch:
        _ranked_in_spark(patch)
        with caplog.at_level("INFO", logger="pipeline.etl.onepass"):
            ranked = run_etl(spark, _clicks_config(conf_dir, tmp_path / "spark"))
    assert "ranking the vocabularies in Spark" in caplog.text
    for name in ("c0", "c1", "c2"):
        assert ranked.vocabulary(name).to_pylist() == driver.vocabulary(name).to_pylist(), name
    assert len(driver.vocabulary("c0")) > 100  # a real vocabulary, with count ties among its values
    for split in ("train", "validation", "test"):
        mine, _ = read_tensors(ranked.files(split), features=ranked.feature_set)
        theirs, _ = read_tensors(driver.files(split), features=driver.feature_set)
        for name in ("c0", "c1", "c2"):
            assert np.array_equal(mine[name].numpy(), theirs[name].numpy()), (split, name)


def test_over_max_vocab_ranked_in_spark_fails_as_in_the_driver(spark, conf_dir, tmp_path, monkeypatch):
    _ranked_in_spark(monkeypatch)
    with pytest.raises(DataError, match=r"'c2' has more than max_vocab=7 distinct train-split values.*hash_buckets"):
        run_etl(spark, _clicks_config(conf_dir, tmp_path, c2_max_vocab=7))
