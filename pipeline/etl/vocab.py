"""Vocabularies of categorical/text features chosen from train-split value counts (issues 15, 47).

The counts are the one-pass encode's per-partition train counts of each distinct value
(udfs/typed_encode.py, a `.dict` file per partition). The rule: the counts summed per (feature, value),
the min_count filter, the order (count desc, value asc: Arrow and Spark both compare strings byte-wise),
the first max_vocab + 1 kept (one more than allowed, so fit_features can name the "over max_vocab" error).
Ids are 0 null, 1 OOV, 2 + position, as udfs/transforms.vocab_ids assigns them.

Two places apply it, with the same result (tests/pipeline/etl/test_vocab.py):
- ``rank_in_spark``: an aggregation and a per-feature top-(max_vocab + 1) in Spark, so the driver receives
  at most max_vocab + 1 values per feature however many distinct values the data has (the driver-side sum
  held every distinct value of every column, once per partition it appeared in: 1.6 GB at 2M click rows
  with 10M-id columns, issue 47);
- ``rank_counts``: the partitions' dictionaries summed in the driver with pyarrow, used while they hold at
  most ``pipeline.etl.onepass.DRIVER_RANK_MAX_ROWS`` rows in all (faster there: no Spark jobs).

Measured and not used (bench/categorical_etl_bench.py, 1M clicks rows, local[2], CPU seconds):
- counting in Spark SQL (one exploded `(feature, value) -> count` aggregation of the 26 string columns):
  20 CPU s, against ~15 for moving them through Arrow in the profile and `pc.value_counts` there
  (the two-pass design this replaced; issue 15's one pass reads the strings once, onepass.py);
- mapping values to ids in Spark (one broadcast left join per feature, StringIndexer-like): 19-26 CPU s
  for 26 columns, against 9-13 for the whole Python lookup pass (JVM decode + Arrow transfer + pyarrow /
  pandas hash lookups). Spark ML's StringIndexer is no better: no min_count, null folded into the unseen
  bucket, and a fitted 1M-label model built element by element through py4j.
"""
from __future__ import annotations

import logging
from typing import Mapping

import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger(__name__)


def rank_counts(counts: pa.Table, limits: Mapping[int, tuple[int, int]]):
    """({feature: values, most frequent first, ties by value}, {feature: distinct values}) from a
    (feature int, value string, n int) table of distinct (feature, value) pairs; `limits`: feature ->
    (min_count, max_vocab). Each vocabulary holds at most max_vocab + 1 values."""
    features = counts.column("feature").to_numpy()
    vocab, distinct = {}, {}
    for i, (min_count, max_vocab) in limits.items():
        mine = counts.filter(pa.array(features == i))
        distinct[i] = mine.num_rows
        kept = mine.filter(pc.greater_equal(mine.column("n"), min_count))
        order = pc.sort_indices(kept, sort_keys=[("n", "descending"), ("value", "ascending")])
        vocab[i] = kept.column("value").take(order[:max_vocab + 1]).combine_chunks().cast(pa.string())
    return vocab, distinct


KEPT, DISTINCT = 0, 1  # rank_in_spark's two kinds of result rows: a kept value (n: its rank), a feature's count


def rank_in_spark(spark, paths: list[str], limits: Mapping[int, tuple[int, int]]):
    """``rank_counts``'s result, computed by Spark from the ``.dict`` files ``paths`` (readable by every
    executor): the driver receives the kept values and one count per feature, nothing else."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from udfs.typed_encode import read_dictionaries

    if not limits:
        return {}, {}
    features = sorted(limits)
    try:
        slots = spark.sparkContext.defaultParallelism
    except Exception:  # Spark Connect: no SparkContext here; one task per file, as many as Spark schedules
        slots = len(paths)
    parallelism = max(1, min(len(paths), slots))
    files = spark.createDataFrame([(p,) for p in paths], "path string").repartition(parallelism)
    rows = files.mapInArrow(read_dictionaries, "feature int, value string, n long")
    counts = (rows.where(F.col("n") > 0).where(F.col("feature").isin(features))
              .groupBy("feature", "value").agg(F.sum("n").alias("n")))

    def per_feature(value: Mapping[int, int]):  # the row's feature's entry of `value`
        column = F.lit(None)
        for i in features:
            column = F.when(F.col("feature") == i, F.lit(value[i])).otherwise(column)
        return column

    min_count = per_feature({i: limits[i][0] for i in features})
    allowed = per_feature({i: limits[i][1] + 1 for i in features})  # max_vocab + 1: enough to say "over"

    widest = max(max_vocab for _, max_vocab in limits.values()) + 1
    order = Window.partitionBy("feature").orderBy(F.col("n").desc(), F.col("value").asc())
    kept = (counts.where(F.col("n") >= min_count)
            .withColumn("rank", F.row_number().over(order))
            # A literal bound first: Spark then keeps each partition's top rows per feature before the
            # shuffle (WindowGroupLimit) instead of moving and sorting every qualifying value.
            .where(F.col("rank") <= widest).where(F.col("rank") <= allowed)
            .select(F.lit(KEPT).alias("kind"), "feature", "value", F.col("rank").cast("long").alias("n")))
    # One query for both: Spark reuses the aggregation's exchange for the two branches instead of summing
    # the counts twice.
    distinct = counts.groupBy("feature").agg(F.count("*").alias("n")).select(
        F.lit(DISTINCT).alias("kind"), "feature", F.lit(None).cast("string").alias("value"), "n")
    table = _to_arrow(spark, kept.unionByName(distinct), widest)
    return _split_ranked(table, features)


def _to_arrow(spark, frame, widest: int) -> pa.Table:
    key = "spark.sql.optimizer.windowGroupLimitThreshold"  # Spark's default (1000) is below most max_vocab
    try:
        previous = spark.conf.get(key, None)
        spark.conf.set(key, str(widest + 1))
    except Exception:  # a session that refuses the setting: the same result, sorted whole
        previous, key = None, None
    try:
        return frame.toArrow()
    finally:
        if key is not None:
            if previous is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, previous)


def _split_ranked(table: pa.Table, features: list[int]):
    is_count = pc.equal(table.column("kind"), DISTINCT)
    counts = table.filter(is_count)
    ranked = table.filter(pc.invert(is_count))
    distinct = dict.fromkeys(features, 0)
    distinct.update(zip(counts.column("feature").to_pylist(), counts.column("n").to_pylist()))
    feature_of = ranked.column("feature").to_numpy()
    vocab = {}
    for i in features:
        mine = ranked.filter(pa.array(feature_of == i))
        order = pc.sort_indices(mine, sort_keys=[("n", "ascending")])
        vocab[i] = mine.column("value").take(order).combine_chunks().cast(pa.string())
    return vocab, distinct
