"""Vocabularies of categorical/text features chosen from train-split value counts (issue 15).

The counts are the one-pass encode's per-partition train counts of each distinct value
(udfs/typed_encode.py), summed in the driver with pyarrow (pipeline/etl/onepass.summed_counts): one row
per distinct value (~1.1M for the clicks bench's 5M rows), never Row objects, ranked there with pyarrow:
min_count filter, order (count desc, value asc: Arrow and Spark both compare strings byte-wise, so this
is the order a Spark `orderBy` gives), the first
max_vocab + 1 kept (one more than allowed, so fit_features can name the "over max_vocab" error). Ids are
0 null, 1 OOV, 2 + position, as udfs/transforms.vocab_ids assigns them.

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
