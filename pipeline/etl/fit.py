"""Fitting typed features on the train split: a profile (or one-pass encode) pass's per-partition summaries
merged, vocabularies checked, medians computed, and the fitted FeatureSpecs built."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pipeline.config.feature_spec import FeatureSpec
from pipeline.etl.clean import MAX_CLASSES, CastFrame, CleanReport, clean_report, describe_input
from pipeline.etl.split import SPLIT_COLUMN
from pipeline.errors import DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
VOCAB_DIR = "vocab"


@dataclass
class Profiles:
    rows: int
    bad_rows: int
    bad: dict[str, int]
    split_rows: dict[str, dict[int, int]]
    offsets: dict[str, dict[int, int]]
    totals: dict[str, int]
    moments: dict[str, tuple[int, float, float]]
    missing: dict[str, int]
    labels: list[str]
    labels_truncated: bool
    unknown_labels: int
    unknown_examples: list[str]
    image_error: str | None
    # feature name -> its values (an Arrow string array) most frequent first, ties by value, at most
    # max_vocab + 1 of those reaching min_count; and the distinct train-split values of each counted feature.
    vocab: dict[str, Any] = field(default_factory=dict)
    distinct: dict[str, int] = field(default_factory=dict)


def counted_features(entries) -> list[int]:
    return [i for i, e in enumerate(entries) if e.type == "text" or (e.type == "categorical" and not e.hash_buckets)]


def merge_profiles(spark, df, entries, data, allowed, source_types: dict[str, str]) -> Profiles:
    """Run the profile pass (udfs/typed_profile.py) without value counts and merge its rows: what a frozen
    fit needs (no vocabulary); a fit reads the source once instead (pipeline/etl/onepass.py)."""
    from udfs.typed_profile import OUTPUT_DDL, make_typed_profile_fn

    counted: list[int] = []
    specs = [raw_spec(e, source_types) for e in entries]
    fn = make_typed_profile_fn(specs, counted, data.label, SPLIT_COLUMN, data.task == "regression",
                               data.task == "classification" and allowed is None, MAX_CLASSES, allowed)
    # Only the columns the pass reads reach Python (Parquet pruning too): no categorical/text column.
    needed = [e.name for i, e in enumerate(entries) if e.type in ("numeric", "vector", "image") or i in counted]
    profiled = df.select(*[f"`{c}`" for c in needed + [data.label, SPLIT_COLUMN]]).mapInArrow(fn, OUTPUT_DDL)
    rows = sorted(profiled.where("kind = 'summary'").select("pid", "summary").collect(), key=lambda r: r["pid"])
    summaries = [(r["pid"], json.loads(r["summary"])) for r in rows]
    return merge_summaries(summaries, entries, {}, {})


def merge_summaries(summaries, entries, vocab, distinct) -> Profiles:
    """Profiles from the per-partition (pid, summary dict) pairs of a profile (or one-pass encode) pass."""
    import numpy as np

    from udfs.profile import merge_moments

    split_rows = {s: {} for s in SPLITS}
    offsets = {s: {} for s in SPLITS}
    totals = dict.fromkeys(SPLITS, 0)
    bad: dict[str, int] = {}
    moments = {e.name: (0, np.zeros(1), np.zeros(1)) for e in entries if e.type == "numeric"}
    missing = {name: 0 for name in moments}
    labels: set[str] = set()
    examples: set[str] = set()
    truncated, image_error = False, None
    for pid, s in summaries:
        for split, n in zip(SPLITS, s["split_rows"]):
            if n:
                split_rows[split][pid] = n
                offsets[split][pid] = totals[split]
                totals[split] += n
        for name, n in s["bad"].items():
            bad[name] = bad.get(name, 0) + n
        for name, (count, mean, m2) in s["moments"].items():
            moments[name] = merge_moments(*moments[name], count, np.array([mean]), np.array([m2]))
            missing[name] += s["missing"][name]
        labels.update(s["labels"])
        examples.update(s["unknown_label_examples"])
        truncated = truncated or s["labels_truncated"]
        image_error = image_error or s["image_error"]
    return Profiles(
        rows=sum(s["rows"] for _, s in summaries), bad_rows=sum(s["bad_rows"] for _, s in summaries), bad=bad,
        split_rows=split_rows, offsets=offsets, totals=totals,
        moments={k: (int(c), float(m[0]), float(q[0])) for k, (c, m, q) in moments.items()}, missing=missing,
        labels=sorted(labels), labels_truncated=truncated,
        unknown_labels=sum(s["unknown_labels"] for _, s in summaries), unknown_examples=sorted(examples)[:5],
        image_error=image_error, vocab=vocab, distinct=distinct)


def raw_spec(entry, source_types: dict[str, str]) -> dict:
    """What the profile's validity check and value counting need of an entry (before fitting)."""
    spec = entry.model_dump()
    if entry.type == "text":
        spec["tokenize"] = source_types.get(entry.name) == "string"  # else an array of tokens
    return spec


def _what_is_invalid(entries) -> str:
    kinds = {e.type for e in entries}
    parts = []
    if "vector" in kinds:
        parts.append("a vector feature's value is invalid when null, of another length than its `length`, or "
                     "not finite")
    if "image" in kinds:
        parts.append("an image feature's value when null or not a decodable image")
    return f" ({'; '.join(parts)})" if parts else ""


def profile_report(p: Profiles, data, entries=()) -> CleanReport:
    """The classic report and judgement (reject / all invalid / empty), with an image decode error named."""
    frame = CastFrame(df=None, cast_columns=[], checked_columns=list(p.bad), text_columns=[])
    try:
        return clean_report(frame, data, p.rows, p.bad_rows, list(p.bad.values()), [], p.unknown_labels,
                            p.unknown_examples)
    except DataError as exc:
        detail = _what_is_invalid(entries) + (f" (first undecodable image: {p.image_error})" if p.image_error else "")
        if detail:
            raise DataError(f"{exc}{detail}") from None
        raise


def _median(spark, df, names: list[str]) -> dict[str, float]:
    """Train-split medians of the named numeric columns by Spark ML's Imputer (nulls/NaN ignored)."""
    if not names:
        return {}
    from pyspark.ml.feature import Imputer
    from pyspark.sql import functions as F

    train = df.where(F.col(SPLIT_COLUMN) == "train").select(*[F.col(f"`{n}`") for n in names])
    model = Imputer(strategy="median", inputCols=names, outputCols=[f"{n}__imputed" for n in names]).fit(train)
    row = model.surrogateDF.collect()[0]
    return {n: float(row[n]) for n in names}


def fit_features(spark, df, p: Profiles, entries, data, source_types: dict[str, str]):
    """(FeatureSpecs in configuration order, {vocabulary path: values as an Arrow string array})."""
    medians = _median(spark, df, [e.name for e in entries if e.type == "numeric" and e.impute == "median"])
    specs, vocabularies = [], {}
    for entry in entries:
        kind, name = entry.type, entry.name
        common = {"name": name, "type": kind, "source_type": source_types.get(name, "")}
        if kind == "numeric":
            count, mean, m2 = p.moments[name]
            if count == 0:
                raise DataError(f"numeric feature {name!r} has no valid value in the train split of "
                                f"{describe_input(data)}; drop it from data.features or fix the input")
            std = (m2 / count) ** 0.5
            standardize = data.standardize if entry.standardize is None else entry.standardize
            fill = (medians[name] if entry.impute == "median" else mean) if entry.impute else 0.0
            specs.append(FeatureSpec(**common, standardize=standardize, mean=mean if standardize else 0.0,
                                     std=(std if std > 1e-12 else 1.0) if standardize else 1.0, impute=entry.impute,
                                     fill=fill, missing_flag=bool(entry.impute) and entry.missing_flag))
        elif kind == "categorical" and entry.hash_buckets:
            specs.append(FeatureSpec(**common, hash_buckets=entry.hash_buckets, embedding_dim=entry.embedding_dim))
        elif kind in ("categorical", "text"):
            values = p.vocab.get(name)
            if values is None:
                import pyarrow as pa

                values = pa.array([], pa.string())
            if len(values) > entry.max_vocab:
                hint = ("set hash_buckets (e.g. hash_buckets: " f"{1 << max(10, (entry.max_vocab * 2).bit_length())})"
                        if kind == "categorical" else "raise max_vocab")
                raise DataError(
                    f"{kind} feature {name!r} has more than max_vocab={entry.max_vocab} distinct train-split values "
                    f"seen at least min_count={entry.min_count} times ({p.distinct.get(name, 0)} distinct in all, "
                    f"{describe_input(data)}); {hint}, raise min_count, or raise max_vocab")
            path = f"{VOCAB_DIR}/{name}.parquet"
            vocabularies[path] = values
            extra = {"max_len": entry.max_len, "tokenize": source_types.get(name) == "string"} if kind == "text" else {}
            specs.append(FeatureSpec(**common, vocab_size=len(values), vocabulary=path, min_count=entry.min_count,
                                     embedding_dim=entry.embedding_dim, distinct_values=p.distinct.get(name, 0),
                                     **extra))
        elif kind == "vector":
            specs.append(FeatureSpec(**common, length=entry.length))
        elif kind == "image":
            specs.append(FeatureSpec(**common, height=entry.height, width=entry.width, channels=entry.channels,
                                     source=entry.source, storage=entry.storage))
    for spec in specs:
        if spec.type in ("categorical", "text") and spec.vocabulary:
            log.info("feature %s: vocabulary of %d values (%d distinct in train, min_count %d)", spec.name,
                     spec.vocab_size, spec.distinct_values, spec.min_count)
    return specs, vocabularies
