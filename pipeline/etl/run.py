"""The ETL step: source -> clean -> split -> train-only statistics -> standardize + pack -> shards."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.config.schema import PipelineConfig
from pipeline.etl.clean import cast_and_filter, feature_columns, index_labels, label_mapping
from pipeline.etl.sources import DIGITS_ID, read_source
from pipeline.etl.synthetic import SYNTHETIC_ID
from pipeline.etl.split import SPLIT_COLUMN, assign_split
from pipeline.etl.stats import train_statistics
from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest
from pipeline.shards.write import SPLITS, write_shards

log = logging.getLogger(__name__)


def shards_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.data.shards_dir) if cfg.data.shards_dir else Path(cfg.workdir) / "shards" / cfg.name


def row_bytes(num_features: int) -> int:
    """Estimated stored bytes of one shard row: float32 vectors barely compress, so the raw size of the
    features plus label and Parquet overhead."""
    return 4 * num_features + 16


def rows_per_file(target_file_mb: float, num_features: int) -> int:
    """Rows that make a shard file of about target_file_mb."""
    return max(1, int(target_file_mb * 2**20 / row_bytes(num_features)))


def _split_offsets(df) -> tuple[dict[str, dict[int, int]], dict[str, int]]:
    """Rows of each split in all earlier partitions, per partition: the base of a global row index."""
    from pyspark.sql import functions as F

    counts = (df.groupBy(F.spark_partition_id().alias("pid"), F.col(SPLIT_COLUMN).alias("split"))
              .count().collect())
    per_split: dict[str, dict[int, int]] = {s: {} for s in SPLITS}
    for row in counts:
        per_split[row["split"]][row["pid"]] = row["count"]
    offsets, totals = {}, {}
    for split, parts in per_split.items():
        running, offsets[split] = 0, {}
        for pid in sorted(parts):
            offsets[split][pid] = running
            running += parts[pid]
        totals[split] = running
    return offsets, totals


def run_etl(spark, cfg: PipelineConfig) -> Manifest:
    """Prepare `cfg.data` into a committed shard set for `cfg.parallelism.data` workers."""
    from pyspark import StorageLevel

    from udfs.pack import make_pack_fn, output_schema_ddl

    started = time.perf_counter()
    data = cfg.data
    raw = read_source(spark, data, cfg.workdir)
    id_column = data.id_column or {"digits": DIGITS_ID, "synthetic": SYNTHETIC_ID}.get(data.source)
    if id_column and id_column not in raw.columns:
        raise DataError(f"id column {id_column!r} (data.id_column) is not in the input; columns: {raw.columns}")
    features = feature_columns(raw.columns, data, id_column)
    selected = raw.select(*dict.fromkeys(([id_column] if id_column else []) + features + [data.label]))
    cleaned, report = cast_and_filter(selected, features, data)

    labels, numeric_labels = (None, False)
    if data.task == "classification":
        labels, numeric_labels = label_mapping(cleaned, data.label)
        cleaned = index_labels(cleaned, data.label, labels, numeric_labels)

    split = assign_split(cleaned, [id_column] if id_column else features + [data.label], data.split)
    # On local disk, not the heap: a wide cached frame (5M rows x 64 doubles) left the aggregations that
    # follow without execution memory (AGGREGATE_OUT_OF_MEMORY at a 4g heap).
    split = split.persist(StorageLevel.DISK_ONLY)
    try:
        offsets, totals = _split_offsets(split)
        workers = cfg.parallelism.data
        if totals["train"] < workers:
            raise DataError(f"the train split has {totals['train']} rows, fewer than parallelism.data={workers} "
                            "workers; use fewer workers or more data")
        for name in ("validation", "test"):
            if totals[name] == 0 and getattr(data.split, name) > 0:
                raise DataError(f"the {name} split is empty ({report.output_rows} valid rows); "
                                f"raise data.split.{name} or add data")
        if data.standardize:
            means, stds = train_statistics(split, features, SPLIT_COLUMN)
        else:
            means, stds = [0.0] * len(features), [1.0] * len(features)
        # One train shard per worker; validation is read whole by rank 0; test is spread for Spark evaluation.
        num_shards = {"train": workers, "validation": min(1, totals["validation"]),
                      "test": min(workers, totals["test"])}
        label_is_integer = data.task == "classification"
        pack = make_pack_fn(features, data.label, SPLIT_COLUMN, means if data.standardize else None,
                            stds if data.standardize else None, offsets, num_shards, label_is_integer)
        packed = split.mapInArrow(pack, output_schema_ddl(label_is_integer))
        etl_report = {**asdict(report), "split_rows": totals, "source": data.source, "path": data.path}
        manifest = write_shards(
            packed, shards_dir(cfg), num_shards=num_shards, name=cfg.name, task=data.task,
            feature_columns=features, label_column=data.label, label_mapping=labels,
            standardized=data.standardize, means=means, stds=stds, etl_report=etl_report,
            rows_per_row_group=cfg.shards.rows_per_row_group,
            rows_per_file=rows_per_file(cfg.shards.target_file_mb, len(features)), row_bytes=row_bytes(len(features)))
    finally:
        split.unpersist()
    log.info("etl done in %.1fs: %d input rows, %d invalid (%s), splits %s", time.perf_counter() - started,
             report.input_rows, report.invalid_rows, data.invalid_rows, totals)
    return manifest
