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
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from pipeline.config.workdir import hidden_sibling
from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest, Shard, ShardFile, SplitShards, fingerprint_files

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")


def staging_dir(target: Path) -> Path:
    return hidden_sibling(target, "staging")


def commit(staging: Path, target: Path) -> None:
    """Swap the finished staging folder in. The old set is moved aside first and removed afterwards."""
    retired = None
    if target.exists():
        retired = hidden_sibling(target, "retired")
        os.replace(target, retired)
    os.replace(staging, target)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _shards_from_files(root: Path, split: str, num_shards: int, files: list[dict]) -> SplitShards:
    by_shard: dict[int, list[ShardFile]] = {i: [] for i in range(num_shards)}
    for f in sorted(files, key=lambda f: f["path"]):
        if f["split"] != split:
            continue
        path = Path(f["path"])
        by_shard[f["shard"]].append(ShardFile(path=str(path.relative_to(root)), rows=f["rows"],
                                              bytes=path.stat().st_size, row_groups=tuple(f["row_groups"])))
    shards = [Shard(index=i, rows=sum(f.rows for f in fs), files=tuple(fs)) for i, fs in by_shard.items()]
    return SplitShards(rows=sum(s.rows for s in shards), shards=tuple(shards))


def _write_vocabularies(root: Path, vocabularies: Mapping[str, Any]) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = []
    for relative, values in sorted(vocabularies.items()):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"value": pa.array(values, pa.string())}), path, compression="zstd")
        written.append(relative)
    return written


def _remove_unreported(root: Path, reported: set[str]) -> int:
    """Delete files that no successful task attempt reported (failed or speculative attempts)."""
    removed = 0
    for file in root.rglob("*.parquet"):
        if str(file) not in reported:
            file.unlink()
            removed += 1
    return removed


def write_shards(
    df,
    pack,
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
    rows_per_row_group: int,
    rows_per_file: int,
    features: Sequence[dict] = (),
    vocabularies: Optional[Mapping[str, Any]] = None,
) -> Manifest:
    """Pack `df` with `pack` (udfs/pack.py) in its Spark tasks, write the shards, commit them as `target`.

    Each task writes its own rows of every (split, shard) it holds (no shuffle), so a shard is one file
    per input partition, or more past rows_per_file; row groups hold exactly rows_per_row_group rows
    (the loader's read unit) except the last of a file. `target` must be visible to the driver and every
    executor (a local path in local mode; a shared mount such as NFS or /dbfs on a cluster).

    `features` are the fitted FeatureSpec dicts; `vocabularies` maps a FeatureSpec.vocabulary path
    (relative to the shard set) to its values (an Arrow string array), written as one-column Parquet files
    inside the set and covered by its fingerprint.
    """
    from udfs.shard_writer import FILES_SCHEMA_DDL, make_write_fn

    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target)
    try:
        staging.mkdir()
        write = make_write_fn(pack, str(staging), rows_per_row_group, rows_per_file)
        files = [row.asDict() for row in df.mapInArrow(write, FILES_SCHEMA_DDL).collect()]
        removed = _remove_unreported(staging, {f["path"] for f in files})
        if removed:
            log.info("removed %d file(s) left by failed or duplicate task attempts", removed)
        splits = {split: _shards_from_files(staging, split, num_shards[split], files) for split in SPLITS}
        for split, info in splits.items():
            counts = [s.rows for s in info.shards]
            if counts and max(counts) - min(counts) > 1:
                raise DataError(f"internal: {split} shards are unbalanced {counts}; please report this")
        header = {"feature_columns": list(feature_columns), "label_mapping": list(label_mapping or []),
                  "means": list(means), "stds": list(stds), "task": task}
        if features:
            header["features"] = list(features)
        files = [f.path for info in splits.values() for s in info.shards for f in s.files]
        files += _write_vocabularies(staging, vocabularies or {})
        manifest = Manifest(
            name=name, task=task, feature_columns=tuple(feature_columns), label_column=label_column,
            label_mapping=tuple(label_mapping) if label_mapping is not None else None,
            standardized=standardized, means=tuple(means), stds=tuple(stds), splits=splits,
            fingerprint=fingerprint_files(staging, files, header), etl_report=dict(etl_report),
            features=tuple(features))
        manifest.write(staging)
        commit(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("committed shard set %s: %s", target,
             ", ".join(f"{k} {v.rows} rows in {len(v.shards)} shards" for k, v in manifest.splits.items()))
    return dataclasses.replace(manifest, root=str(target))
