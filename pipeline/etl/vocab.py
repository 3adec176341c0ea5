"""Vocabularies of categorical features counted, ranked and applied in the JVM (issue 15).

Moving a string column through Arrow into a Python worker costs ~5x what a double column does, and the
typed ETL used to do it twice per categorical (value counts in the profile pass, the id lookup in the
pack). Here both happen in Spark SQL instead, so the Python pack step receives int32 ids:

- counting: one exploded aggregation `(feature, value) -> n` over the valid train rows (`value_counts`),
  whose validity rule (`valid_rows`) is the SQL form of udfs/transforms.Transform.check + the label check;
- ranking: min_count filter, order (count desc, value asc), the first max_vocab + 1 kept (one more than
  allowed, so fit_features can name the "over max_vocab" error), collected as Arrow (`ranked_vocabularies`);
- mapping: one broadcast left join per feature against its vocabulary (`map_to_ids`): null -> 0 (NULL_ID),
  a value not in the vocabulary -> 1 (OOV_ID), position p -> 2 + p, exactly udfs/transforms.vocab_ids.

Only categoricals whose text form is the same in Spark and in udfs/transforms.as_text take this path
(`jvm_exact`): strings, integers and booleans (cast to string by cast_columns). Float categoricals (as_text
writes a whole float as an integer, Spark as "3.0"), text tokens (tokenized in Python) and hashed
categoricals (blake2b, no JVM equivalent) stay in Python.

Why not Spark ML's StringIndexer: it has no min_count, folds null into the unseen bucket, and building a
StringIndexerModel from a fitted 1M-label array goes element by element through py4j; the join needs none
of that and its output order is the left side's (a broadcast join streams each partition as it is), which
the pack step's shard dealing relies on.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from pipeline.etl.split import SPLIT_COLUMN

log = logging.getLogger(__name__)

# Spark types whose cast to string equals udfs/transforms.as_text of the Arrow column (decimal integers,
# strings as they are; booleans arrive as "true"/"false" strings from cast_columns either way).
_EXACT_TYPES = ("string", "tinyint", "smallint", "int", "bigint", "boolean")
_INF = float("inf")


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def jvm_exact(entry, source_types: Mapping[str, str]) -> bool:
    """A learned-vocabulary categorical whose values Spark writes as text exactly as the served model does."""
    return entry.type == "categorical" and not entry.hash_buckets and source_types.get(entry.name) in _EXACT_TYPES


def _finite(column):
    from pyspark.sql import functions as F

    return column.isNotNull() & ~F.isnan(column) & (F.abs(column) != F.lit(_INF))


def valid_rows(df, entries, data, allowed: Optional[Mapping[str, pa.Array]]):
    """The rows the pack step keeps, as a Spark SQL condition, or None where that rule is not expressible
    in SQL (an image is valid only if PIL decodes it; labels checked against classes of another type)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import NumericType, StringType

    condition = F.lit(True)
    for entry in entries:
        col = F.col(_q(entry.name))
        if entry.type == "numeric" and not entry.impute:
            condition &= _finite(col)  # Transform.check: a missing value of a non-imputed feature
        elif entry.type == "vector":
            condition &= col.isNotNull() & (F.size(col) == entry.length) & F.forall(col, _finite)
        elif entry.type == "image":
            return None
    label = F.col(_q(data.label))
    if data.task == "regression":
        return condition & _finite(label)
    condition &= label.isNotNull()
    if allowed is not None:
        values = allowed[data.label]
        label_type = df.schema[data.label].dataType
        if pa.types.is_floating(values.type) and isinstance(label_type, NumericType):
            condition &= label.cast("double").isin(values.to_pylist())
        elif pa.types.is_string(values.type) and isinstance(label_type, StringType):
            condition &= label.isin(values.to_pylist())
        else:
            return None
    return condition


def value_counts(df, features: Mapping[int, str], valid):
    """(feature, value, n) over the train rows meeting `valid`: one exploded aggregation for all features
    (one scan of the source; Spark's partial aggregation keeps distinct values per partition only)."""
    from pyspark.sql import functions as F

    pairs = F.array(*[F.struct(F.lit(i).cast("int").alias("feature"), F.col(_q(name)).cast("string").alias("value"))
                      for i, name in features.items()])
    train = df.where((F.col(SPLIT_COLUMN) == "train") & valid)
    return (train.select(F.inline(pairs)).where(F.col("value").isNotNull())
            .groupBy("feature", "value").agg(F.count(F.lit(1)).alias("n")))


def ranked_vocabularies(counts, limits: Mapping[int, tuple[int, int]]):
    """({feature: values, most frequent first, ties by value}, {feature: distinct values}) from a
    (feature, value, n) DataFrame; `limits`: feature -> (min_count, max_vocab). Each vocabulary holds at most
    max_vocab + 1 values (one more says it is over). Only the kept values reach the driver, as Arrow."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if not limits:
        return {}, {}

    def per_feature(values: dict[int, int]):
        return F.element_at(F.create_map(*[F.lit(x) for i, v in values.items() for x in (i, v)]), F.col("feature"))

    counts = counts.cache()
    try:
        distinct = {int(r["feature"]): int(r["k"])
                    for r in counts.groupBy("feature").agg(F.count(F.lit(1)).alias("k")).collect()}
        order = Window.partitionBy("feature").orderBy(F.col("n").desc(), F.col("value"))
        ranked = (counts.where(F.col("n") >= per_feature({i: m for i, (m, _) in limits.items()}))
                  .withColumn("rank", F.row_number().over(order))
                  .where(F.col("rank") <= per_feature({i: v + 1 for i, (_, v) in limits.items()})))
        table = ranked.select("feature", "rank", "value").toArrow()
    finally:
        counts.unpersist()
    table = table.sort_by([("feature", "ascending"), ("rank", "ascending")])
    features = table.column("feature").to_numpy()
    values = table.column("value").combine_chunks().cast(pa.string())
    vocab = {}
    for i in limits:
        rows = np.flatnonzero(features == i)
        vocab[i] = values.slice(int(rows[0]), len(rows)) if len(rows) else pa.array([], pa.string())
    return vocab, {i: distinct.get(i, 0) for i in limits}


def vocab_frame(spark, vocabularies: Sequence[tuple[int, pa.Array]]):
    """A (feature, value, id) DataFrame of the given vocabularies, ids as udfs/transforms assigns them."""
    from udfs.transforms import FIRST_ID

    parts = [pa.table({"feature": pa.array(np.full(len(v), i, np.int32)), "value": v.cast(pa.string()),
                       "id": pa.array(np.arange(FIRST_ID, FIRST_ID + len(v), dtype=np.int32))})
             for i, v in vocabularies]
    table = pa.concat_tables(parts) if parts else pa.table({"feature": pa.array([], pa.int32()),
                                                            "value": pa.array([], pa.string()),
                                                            "id": pa.array([], pa.int32())})
    return spark.createDataFrame(table)


def map_to_ids(spark, df, vocabularies: Mapping[str, pa.Array]):
    """(`df` with each named categorical column replaced by its int32 id (0 null, 1 not in the vocabulary,
    2 + position), rows and partitions as they were (broadcast left joins stream the left side); the cached
    vocabulary frame the joins read, to unpersist after the write, or None)."""
    from pyspark.sql import functions as F

    from udfs.transforms import NULL_ID, OOV_ID

    if not vocabularies:
        return df, None
    names = list(vocabularies)
    frame = vocab_frame(spark, [(i, vocabularies[n]) for i, n in enumerate(names)]).cache()
    joined = df
    for i, name in enumerate(names):
        right = frame.where(F.col("feature") == i).select(F.col("value").alias(f"__vocab_value_{i}"),
                                                          F.col("id").alias(f"__vocab_id_{i}"))
        joined = joined.join(F.broadcast(right), F.col(_q(name)).cast("string") == F.col(f"__vocab_value_{i}"), "left")
    ids = {name: F.when(F.col(_q(name)).isNull(), F.lit(NULL_ID))
           .otherwise(F.coalesce(F.col(f"__vocab_id_{i}"), F.lit(OOV_ID))).cast("int").alias(name)
           for i, name in enumerate(names)}
    return joined.select(*[ids.get(c, F.col(_q(c))) for c in df.columns]), frame
