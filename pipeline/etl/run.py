"""The ETL step: source -> clean -> split -> train-only statistics -> standardize + pack -> shards."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.config.feature_spec import FeatureSet
from pipeline.config.features import is_plain
from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.etl.clean import (
    MAX_CLASSES, NONNUM_FLAGS, CastFrame, CleanReport, cast_with_flags, clean_report, configured_classes,
    describe_input, feature_columns, label_mapping)
from pipeline.etl.checks import check_split_sizes, input_errors
from pipeline.etl.sources import DIGITS_ID, read_source
from pipeline.etl.synthetic import SYNTHETIC_ID
from pipeline.etl.split import SPLIT_COLUMN, assign_split
from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest
from pipeline.shards.write import SPLITS, write_shards

log = logging.getLogger(__name__)


def shards_dir(cfg: PipelineConfig) -> Path:
    return Workdir.of(cfg).shards


def row_bytes(num_features: int) -> int:
    """Estimated stored bytes of one shard row: float32 vectors barely compress, so the raw size of the
    features plus the label."""
    return 4 * num_features + 16


def rows_per_file(target_file_mb: float, num_features: int) -> int:
    """Rows that make a shard file of about target_file_mb."""
    return max(1, int(target_file_mb * 2**20 / row_bytes(num_features)))


@dataclass
class Profile:
    """What the profile pass learned: cleaning counts, split sizes per partition, train moments, labels."""
    report: CleanReport
    split_rows: dict[str, dict[int, int]]
    offsets: dict[str, dict[int, int]]
    totals: dict[str, int]
    means: list[float]
    stds: list[float]
    labels: list[str]
    label_values_truncated: bool


def profile(frame: CastFrame, features: list[str], data, label_values: list[str] | None = None,
            numeric_labels: bool = False) -> Profile:
    """One read of the source, summarized per partition by a vectorized Arrow UDF, merged here."""
    import numpy as np

    from udfs.profile import (MAX_LABEL_EXAMPLES, SPLITS as PROFILE_SPLITS, make_profile_fn, merge_moments,
                              output_schema_ddl)

    others = [c for c in frame.checked_columns if c not in frame.cast_columns]
    fn = make_profile_fn(features, data.label, SPLIT_COLUMN, frame.cast_columns, others,
                         NONNUM_FLAGS if frame.text_columns else None, len(frame.text_columns), MAX_CLASSES,
                         collect_labels=data.task == "classification" and label_values is None,
                         label_values=label_values, numeric_labels=numeric_labels)
    with input_errors(data):
        rows = sorted(frame.df.mapInArrow(fn, output_schema_ddl()).collect(), key=lambda r: r["pid"])
    input_rows = sum(r["rows"] for r in rows)
    bad = np.sum([r["bad"] for r in rows], axis=0, dtype=np.int64) if rows else []
    nonnum = np.sum([r["nonnum"] for r in rows], axis=0, dtype=np.int64) if rows else []
    examples = sorted({v for r in rows for v in r["unknown_label_examples"]})[:MAX_LABEL_EXAMPLES]
    report = clean_report(frame, data, input_rows, sum(r["bad_rows"] for r in rows),
                          [int(v) for v in bad], [int(v) for v in nonnum],
                          sum(r["unknown_labels"] for r in rows), examples)
    split_rows: dict[str, dict[int, int]] = {s: {} for s in SPLITS}
    offsets: dict[str, dict[int, int]] = {s: {} for s in SPLITS}
    totals = dict.fromkeys(SPLITS, 0)
    count, mean, m2 = 0, np.zeros(len(features)), np.zeros(len(features))
    labels: set[str] = set()
    truncated = False
    for r in rows:
        for split, n in zip(PROFILE_SPLITS, r["split_rows"]):
            if n:
                split_rows[split][r["pid"]] = n
                offsets[split][r["pid"]] = totals[split]
                totals[split] += n
        count, mean, m2 = merge_moments(count, mean, m2, r["train_count"], np.asarray(r["train_mean"]),
                                        np.asarray(r["train_m2"]))
        labels.update(r["labels"])
        truncated = truncated or r["labels_truncated"]
    std = np.sqrt(m2 / count) if count else np.ones(len(features))
    stds = [float(v) if v > 1e-12 else 1.0 for v in std]  # a constant feature: no divide by 0
    return Profile(report, split_rows, offsets, totals, [float(v) for v in mean], stds, sorted(labels), truncated)


def run_etl(spark, cfg: PipelineConfig, statistics: tuple[list[float], list[float]] | None = None,
            pinned=None) -> Manifest:
    """Prepare `cfg.data` into a committed shard set for `cfg.parallelism.data` workers.

    `pinned`: a Delta/Iceberg table already pinned (the workflow's increment), else the source is pinned here.
    Two reads of the source and no shuffle: a profile pass (counts, split sizes per partition, train
    statistics, labels) and a pack pass that standardizes, assigns balanced shards and writes them.
    """
    from pyspark.sql.types import NumericType

    from udfs.pack import make_pack_fn

    from pipeline.config.sources import at_version
    from pipeline.etl.pinning import etl_key, pin_source, reusable, source_report

    started = time.perf_counter()
    given = pinned is not None
    if not given:
        data, pinned = pin_source(cfg.data)
    else:  # the workflow's increment: some files of a pinned version (pipeline.tables.changes), never reused
        data = at_version(cfg.data, pinned.version)
    cfg = cfg.model_copy(update={"data": data})
    key = etl_key(cfg, statistics, pinned) if pinned is not None and not given else None
    reused = reusable(cfg, key)
    if reused is not None:
        log.info("shard set %s reused: it was made from %s with these settings (fingerprint %s)", reused.root,
                 pinned.describe(), reused.fingerprint)
        return reused
    source = source_report(data, pinned, key)
    raw = read_source(spark, data, cfg.workdir, pinned)
    id_column = data.id_column or {"digits": DIGITS_ID, "digits_images": DIGITS_ID, "synthetic": SYNTHETIC_ID,
                                   "clicks": SYNTHETIC_ID}.get(data.source)
    if id_column and id_column not in raw.columns:
        raise DataError(f"id column {id_column!r} (data.id_column) is not in the input ({describe_input(data)}; "
                        f"columns present: {raw.columns}); set data.id_column to the column that identifies a "
                        "row, or to null to hash each row's values")
    features = feature_columns(raw.columns, data, id_column)
    selected = raw.select(*dict.fromkeys(([id_column] if id_column else []) + features + [data.label]))
    numeric_labels = data.task == "classification" and isinstance(selected.schema[data.label].dataType, NumericType)
    # data.classes: the label set and its order are configured; rows with other labels are invalid rows.
    classes = None if data.classes is None else configured_classes(
        data.classes, data.label, selected.schema[data.label].dataType.simpleString(), numeric_labels)
    if not is_plain(data.features):
        from pipeline.etl.typed import run_typed_etl

        return run_typed_etl(spark, cfg, selected, id_column, classes, numeric_labels, statistics, started, source)
    frame = cast_with_flags(selected, features, data)
    frame = dataclasses.replace(frame, df=assign_split(
        frame.df, [id_column] if id_column else features + [data.label], data.split))
    prof = profile(frame, features, data, classes, numeric_labels)
    log.info("profile pass: %d rows in %.1fs", prof.report.input_rows, time.perf_counter() - started)
    report, totals = prof.report, prof.totals

    labels = None
    if data.task == "classification":
        labels = classes if classes is not None else label_mapping(
            prof.labels, prof.label_values_truncated, data.label, numeric_labels)

    num_shards = check_split_sizes(totals, report, data, cfg.parallelism.data, cfg.train.batch_size)
    means, stds = (prof.means, prof.stds) if data.standardize else ([0.0] * len(features), [1.0] * len(features))
    if statistics is not None and data.standardize:
        # Frozen statistics (the incremental workflow's later partitions): every partition is scaled alike.
        means, stds = list(statistics[0]), list(statistics[1])
        if len(means) != len(features) or len(stds) != len(features):
            raise DataError(f"the frozen statistics cover {len(means)} features, the input has {len(features)} "
                            f"({features}); the source's columns changed: start a new workflow state")
    pack = make_pack_fn(features, data.label, SPLIT_COLUMN, means if data.standardize else None,
                        stds if data.standardize else None, prof.offsets, prof.split_rows, num_shards,
                        labels, numeric_labels, frame.cast_columns,
                        [c for c in frame.checked_columns if c not in frame.cast_columns],
                        restrict_labels=classes is not None)
    etl_report = {**asdict(report), "split_rows": totals, **source}
    with input_errors(data):
        manifest = write_shards(
            frame.df, pack, shards_dir(cfg), num_shards=num_shards, name=cfg.name, task=data.task,
            feature_columns=features, label_column=data.label,
            label_mapping=list(data.classes) if classes is not None else labels,
            standardized=data.standardize, means=means, stds=stds, etl_report=etl_report,
            features=FeatureSet.numeric_only(features, means, stds, data.standardize).to_list(),
            rows_per_row_group=cfg.shards.rows_per_row_group,
            rows_per_file=rows_per_file(cfg.shards.target_file_mb, len(features)))
    for split, info in manifest.splits.items():
        if info.rows != totals[split]:
            raise DataError(f"internal: wrote {info.rows} {split} rows but profiled {totals[split]}; please report this")
    log.info("etl done in %.1fs: %d input rows, %d invalid (%s), splits %s", time.perf_counter() - started,
             report.input_rows, report.invalid_rows, data.invalid_rows, totals)
    return manifest
