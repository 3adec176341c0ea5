"""The profile pass of typed features: per partition, what the fit step needs, from one read.

Runs under `DataFrame.mapInArrow`. Per partition it yields one `summary` row (a JSON text: row and
invalid counts per column, split sizes of the valid rows, train-split moments and missing counts of each
numeric feature, the label values) and, for every categorical/text feature that learns a vocabulary,
`count` rows (feature index, value, train-split occurrences) already summed within the partition, so
Spark's shuffle and the driver see distinct values, never raw rows. Row validity is decided by
udfs/transforms.Transform.check, the same code the pack step applies, so the split sizes counted here
are exactly the rows the pack step writes. `PartitionProfile` is that per-partition bookkeeping, shared
with the one-pass encode (udfs/typed_encode.py).
"""
from __future__ import annotations

import json
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from udfs.profile import MAX_LABEL_EXAMPLES, SPLITS, invalid_flags, merge_moments, outside
from udfs.transforms import Transform, as_text, flat_tokens, tokens_of

OUTPUT_DDL = "kind string, pid int, summary string, feature int, value string, count bigint"


def _schema() -> pa.Schema:
    return pa.schema([("kind", pa.string()), ("pid", pa.int32()), ("summary", pa.string()),
                      ("feature", pa.int32()), ("value", pa.string()), ("count", pa.int64())])


def label_flags(batch: pa.RecordBatch, label: str, regression: bool,
                allowed: Optional[Mapping[str, pa.Array]]) -> np.ndarray:
    """Rows whose label is invalid: null (NaN/inf too for regression) or outside the configured classes."""
    flags = invalid_flags(batch, [label] if regression else [], [] if regression else [label], allowed)
    return flags[:, 0]


class PartitionProfile:
    """One partition's counts, split sizes, numeric moments, labels and (for `counted` features) train
    value counts, fed batch by batch."""

    def __init__(self, specs: Sequence[dict], counted: Sequence[int], label: str, split_column: str,
                 regression: bool, collect_labels: bool, max_labels: int,
                 allowed: Optional[Mapping[str, pa.Array]]):
        self.specs, self.counted, self.label, self.split_column = list(specs), list(counted), label, split_column
        self.regression, self.collect_labels, self.max_labels, self.allowed = (regression, collect_labels,
                                                                               max_labels, allowed)
        self.transform = Transform(specs, {})
        self.numeric = [i for i, s in enumerate(specs) if s["type"] == "numeric"]
        self.stats_columns = [self.specs[i]["name"] for i in self.numeric + self.counted]
        self.rows = self.bad_rows = self.unknown = 0
        self.bad: dict[str, int] = {}
        self.split_rows = np.zeros(len(SPLITS), dtype=np.int64)
        self.moments = {i: (0, np.zeros(1), np.zeros(1)) for i in self.numeric}
        self.missing = dict.fromkeys(self.numeric, 0)
        self.labels: set[str] = set()
        self.examples: set[str] = set()
        self.image_error = None
        self.value_counts: dict[int, list[pa.Table]] = {i: [] for i in self.counted}

    def add(self, batch: pa.RecordBatch):
        """(table, valid [n], train [n]: valid train rows) of a non-empty batch, its statistics taken."""
        label = self.label
        self.rows += batch.num_rows
        table = pa.Table.from_batches([batch])
        invalid, counts, error = self.transform.check(table)
        self.image_error = self.image_error or error
        for name, n in counts.items():
            self.bad[name] = self.bad.get(name, 0) + n
        label_bad = label_flags(batch, label, self.regression, self.allowed)
        if label_bad.any():
            self.bad[label] = self.bad.get(label, 0) + int(label_bad.sum())
        if self.allowed is not None:
            mask = outside(batch.column(label), self.allowed[label])
            if mask.any():
                self.unknown += int(mask.sum())
                if len(self.examples) < MAX_LABEL_EXAMPLES:
                    odd = pc.unique(batch.column(label).filter(pa.array(mask))).to_pylist()
                    self.examples.update(str(v) for v in odd[:MAX_LABEL_EXAMPLES])
        valid = ~(invalid | label_bad)
        self.bad_rows += int((~valid).sum())
        splits = batch.column(self.split_column).to_numpy(zero_copy_only=False)
        for i, name in enumerate(SPLITS):
            self.split_rows[i] += int(((splits == name) & valid).sum())
        train = (splits == "train") & valid
        if train.any() and self.stats_columns:
            # Only the columns the statistics read are filtered: the one-pass encode's batches also carry
            # every categorical's text, which a whole-table filter would copy for nothing.
            self._train_stats(table.select(self.stats_columns).filter(pa.array(train)))
        if self.collect_labels and len(self.labels) <= self.max_labels:
            self.labels.update(str(v) for v in pc.unique(batch.column(label).filter(pa.array(valid))).to_pylist())
        return table, valid, train

    def _train_stats(self, train_rows: pa.Table) -> None:
        specs = self.specs
        for i in self.numeric:
            values = train_rows.column(specs[i]["name"]).to_numpy().astype(np.float64)
            present = values[np.isfinite(values)]
            self.missing[i] += len(values) - len(present)
            if len(present):
                mean = present.mean(keepdims=True)
                m2 = ((present - mean) ** 2).sum(keepdims=True)
                self.moments[i] = merge_moments(*self.moments[i], len(present), mean, m2)
        for i in self.counted:
            spec = specs[i]
            column = train_rows.column(spec["name"]).combine_chunks()
            values = flat_tokens(tokens_of(column, bool(spec.get("tokenize"))))[0] \
                if spec["type"] == "text" else as_text(column).drop_null()
            if len(values):
                found = pc.value_counts(values)
                self.value_counts[i].append(pa.table({"value": found.field("values"),
                                                      "count": found.field("counts").cast(pa.int64())}))

    def summary(self) -> dict:
        specs, max_labels = self.specs, self.max_labels
        return {"rows": self.rows, "bad_rows": self.bad_rows, "bad": self.bad, "split_rows": self.split_rows.tolist(),
                "moments": {specs[i]["name"]: [int(c), float(m[0]), float(q[0])]
                            for i, (c, m, q) in self.moments.items()},
                "missing": {specs[i]["name"]: int(n) for i, n in self.missing.items()},
                "labels": sorted(self.labels)[:max_labels + 1], "labels_truncated": len(self.labels) > max_labels,
                "unknown_labels": self.unknown, "unknown_label_examples": sorted(self.examples)[:MAX_LABEL_EXAMPLES],
                "image_error": self.image_error}

    def counts(self) -> Iterator[tuple[int, pa.Array, pa.Array]]:
        """(feature index, distinct values, their train counts) of each counted feature seen in train rows."""
        for i, parts in self.value_counts.items():
            if parts:
                merged = pa.concat_tables(parts).group_by("value").aggregate([("count", "sum")])
                yield (i, merged.column("value").combine_chunks().cast(pa.string()),
                       merged.column("count_sum").combine_chunks().cast(pa.int64()))


def make_typed_profile_fn(specs: Sequence[dict], counted: Sequence[int], label: str, split_column: str,
                          regression: bool, collect_labels: bool, max_labels: int,
                          allowed: Optional[Mapping[str, pa.Array]]) -> Callable[[Iterator[pa.RecordBatch]],
                                                                                   Iterator[pa.RecordBatch]]:
    """`counted`: indices into `specs` of the categorical/text features whose values are counted."""

    def profile(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        pid = TaskContext.get().partitionId()
        state = PartitionProfile(specs, counted, label, split_column, regression, collect_labels, max_labels, allowed)
        for batch in batches:
            if batch.num_rows:
                state.add(batch)
        yield pa.RecordBatch.from_pylist([{"kind": "summary", "pid": pid, "summary": json.dumps(state.summary()),
                                           "feature": None, "value": None, "count": None}], schema=_schema())
        for i, values, counts in state.counts():
            n = len(values)
            yield pa.RecordBatch.from_arrays(
                [pa.array(["count"] * n, pa.string()), pa.array(np.full(n, pid, np.int32)), pa.nulls(n, pa.string()),
                 pa.array(np.full(n, i, np.int32)), values, counts], schema=_schema())

    return profile
