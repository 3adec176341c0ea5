"""Write a packed DataFrame as balanced Parquet shards per split, plus manifest.json, atomically.

Everything goes to a hidden staging folder beside the target; only when every file and the manifest
are written is the staging folder renamed into place. A failed or killed ETL leaves the previous shard
set (or nothing) — never a half-written one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest, Shard, ShardFile, SplitShards, fingerprint_files

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")


def staging_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:12]}"


def commit(staging: Path, target: Path) -> None:
    """Swap the finished staging folder in. The old set is moved aside first and removed afterwards."""
    retired = None
    if target.exists():
        retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex[:12]}"
        os.replace(target, retired)
    os.replace(staging, target)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _collect_shards(root: Path, split: str, num_shards: int) -> SplitShards:
    import pyarrow.parquet as pq

    shards = []
    for index in range(num_shards):
        folder = root / f"split={split}" / f"shard={index}"
        files = []
        for file in sorted(folder.glob("*.parquet")) if folder.exists() else []:
            metadata = pq.ParquetFile(file).metadata  # the footer only
            groups = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
            files.append(ShardFile(path=str(file.relative_to(root)), rows=metadata.num_rows,
                                   bytes=file.stat().st_size, row_groups=groups))
        shards.append(Shard(index=index, rows=sum(f.rows for f in files), files=tuple(files)))
    return SplitShards(rows=sum(s.rows for s in shards), shards=tuple(shards))


def write_shards(
    packed_df,
    target: str | os.PathLike,
    *,
    num_shards: Mapping[str, int],
    name: str,
    task: str,
    feature_columns: Sequence[str],
    label_column: str,
    label_mapping: Optional[Sequence[str]],
    standardized: bool,
    means: Sequence[float],
    stds: Sequence[float],
    etl_report: Mapping[str, Any],
    rows_per_row_group: Optional[int] = None,
    rows_per_file: Optional[int] = None,
    row_bytes: Optional[int] = None,
) -> Manifest:
    """Write `packed_df` (columns features, label, split, shard) and commit it as the shard set `target`.

    rows_per_row_group caps Parquet row groups (the loader's read unit); rows_per_file splits a large
    shard into several files; row_bytes is the estimated bytes of one row.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target)
    try:
        # One shuffle so each (split, shard) is written by one task into one file.
        writer = packed_df.repartition("split", "shard").write.mode("errorifexists")
        if rows_per_row_group:
            # parquet-java >= 1.17 (Spark 4.3) caps rows per row group exactly; older ones (Spark 4.0's
            # 1.15) ignore that key, so a byte target sized for the same rows bounds the groups there too
            # (checked every 100+ rows, so groups are approximate on those).
            writer = writer.option("parquet.block.row.count.limit", str(rows_per_row_group))
            if row_bytes:
                writer = writer.option("parquet.block.size", str(max(1024, int(rows_per_row_group * row_bytes * 1.25))))
        if rows_per_file:
            writer = writer.option("maxRecordsPerFile", str(rows_per_file))
        writer.partitionBy("split", "shard").parquet(str(staging))
        splits = {split: _collect_shards(staging, split, num_shards[split]) for split in SPLITS}
        for split, info in splits.items():
            counts = [s.rows for s in info.shards]
            if counts and max(counts) - min(counts) > 1:
                raise DataError(f"internal: {split} shards are unbalanced {counts}; please report this")
        header = {"feature_columns": list(feature_columns), "label_mapping": list(label_mapping or []),
                  "means": list(means), "stds": list(stds), "task": task}
        files = [f.path for info in splits.values() for s in info.shards for f in s.files]
        manifest = Manifest(
            name=name, task=task, feature_columns=tuple(feature_columns), label_column=label_column,
            label_mapping=tuple(label_mapping) if label_mapping is not None else None,
            standardized=standardized, means=tuple(means), stds=tuple(stds), splits=splits,
            fingerprint=fingerprint_files(staging, files, header), etl_report=dict(etl_report))
        manifest.write(staging)
        commit(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("committed shard set %s: %s", target,
             ", ".join(f"{k} {v.rows} rows in {len(v.shards)} shards" for k, v in manifest.splits.items()))
    return dataclasses.replace(manifest, root=str(target))
