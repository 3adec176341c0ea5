"""The profile pass of typed features: per partition, what the fit step needs, from one read.

Runs under `DataFrame.mapInArrow`. Per partition it yields one `summary` row (a JSON text: row and
invalid counts per column, split sizes of the valid rows, train-split moments and missing counts of each
numeric feature, the label values) and, for every categorical/text feature that learns a vocabulary,
`count` rows (feature index, value, train-split occurrences) already summed within the partition, so
Spark's shuffle and the driver see distinct values, never raw rows. Row validity is decided by
udfs/transforms.Transform.check, the same code the pack step applies, so the split sizes counted here
are exactly the rows the pack step writes.
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


def make_typed_profile_fn(specs: Sequence[dict], counted: Sequence[int], label: str, split_column: str,
                          regression: bool, collect_labels: bool, max_labels: int,
                          allowed: Optional[Mapping[str, pa.Array]]) -> Callable[[Iterator[pa.RecordBatch]],
                                                                                   Iterator[pa.RecordBatch]]:
    """`counted`: indices into `specs` of the categorical/text features whose values are counted."""
    transform = Transform(specs, {})
    numeric = [i for i, s in enumerate(specs) if s["type"] == "numeric"]

    def profile(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        pid = TaskContext.get().partitionId()
        rows = bad_rows = unknown = 0
        bad: dict[str, int] = {}
        split_rows = np.zeros(len(SPLITS), dtype=np.int64)
        moments = {i: (0, np.zeros(1), np.zeros(1)) for i in numeric}
        missing = dict.fromkeys(numeric, 0)
        labels: set[str] = set()
        examples: set[str] = set()
        image_error = None
        value_counts: dict[int, list[pa.Table]] = {i: [] for i in counted}
        for batch in batches:
            if batch.num_rows == 0:
                continue
            rows += batch.num_rows
            table = pa.Table.from_batches([batch])
            invalid, counts, error = transform.check(table)
            image_error = image_error or error
            for name, n in counts.items():
                bad[name] = bad.get(name, 0) + n
            label_bad = label_flags(batch, label, regression, allowed)
            if label_bad.any():
                bad[label] = bad.get(label, 0) + int(label_bad.sum())
            if allowed is not None:
                mask = outside(batch.column(label), allowed[label])
                if mask.any():
                    unknown += int(mask.sum())
                    if len(examples) < MAX_LABEL_EXAMPLES:
                        odd = pc.unique(batch.column(label).filter(pa.array(mask))).to_pylist()
                        examples.update(str(v) for v in odd[:MAX_LABEL_EXAMPLES])
            valid = ~(invalid | label_bad)
            bad_rows += int((~valid).sum())
            splits = batch.column(split_column).to_numpy(zero_copy_only=False)
            for i, name in enumerate(SPLITS):
                split_rows[i] += int(((splits == name) & valid).sum())
            train = (splits == "train") & valid
            if not train.any():
                continue
            train_rows = table.filter(pa.array(train))
            for i in numeric:
                values = train_rows.column(specs[i]["name"]).to_numpy().astype(np.float64)
                present = values[np.isfinite(values)]
                missing[i] += len(values) - len(present)
                if len(present):
                    mean = present.mean(keepdims=True)
                    m2 = ((present - mean) ** 2).sum(keepdims=True)
                    moments[i] = merge_moments(*moments[i], len(present), mean, m2)
            for i in counted:
                spec = specs[i]
                column = train_rows.column(spec["name"]).combine_chunks()
                values = flat_tokens(tokens_of(column, bool(spec.get("tokenize"))))[0] \
                    if spec["type"] == "text" else as_text(column).drop_null()
                if len(values):
                    found = pc.value_counts(values)
                    value_counts[i].append(pa.table({"value": found.field("values"),
                                                     "count": found.field("counts").cast(pa.int64())}))
            if collect_labels and len(labels) <= max_labels:
                labels.update(str(v) for v in pc.unique(batch.column(label).filter(pa.array(valid))).to_pylist())
        summary = {"rows": rows, "bad_rows": bad_rows, "bad": bad, "split_rows": split_rows.tolist(),
                   "moments": {specs[i]["name"]: [int(c), float(m[0]), float(q[0])] for i, (c, m, q) in moments.items()},
                   "missing": {specs[i]["name"]: int(n) for i, n in missing.items()},
                   "labels": sorted(labels)[:max_labels + 1], "labels_truncated": len(labels) > max_labels,
                   "unknown_labels": unknown, "unknown_label_examples": sorted(examples)[:MAX_LABEL_EXAMPLES],
                   "image_error": image_error}
        yield pa.RecordBatch.from_pylist([{"kind": "summary", "pid": pid, "summary": json.dumps(summary),
                                           "feature": None, "value": None, "count": None}], schema=_schema())
        for i, parts in value_counts.items():
            if not parts:
                continue
            merged = pa.concat_tables(parts).group_by("value").aggregate([("count", "sum")])
            n = merged.num_rows
            yield pa.RecordBatch.from_arrays(
                [pa.array(["count"] * n, pa.string()), pa.array(np.full(n, pid, np.int32)), pa.nulls(n, pa.string()),
                 pa.array(np.full(n, i, np.int32)), merged.column("value").combine_chunks().cast(pa.string()),
                 merged.column("count_sum").combine_chunks().cast(pa.int64())], schema=_schema())

    return profile
