"""Write a packed DataFrame as balanced Parquet shards per split, plus manifest.json, atomically.

Locally everything goes to a hidden staging folder beside the target; only when every file and the
manifest are written is the staging folder renamed into place. On an object store (no rename) the files
go under a fresh prefix inside the target and the manifest is published last (pipeline/shards/publish.py).
Either way a failed or killed ETL leaves the previous shard set (or nothing) — never a half-written one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from pipeline import storage
from pipeline.config.workdir import hidden_sibling
from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest, Shard, ShardFile, SplitShards, fingerprint_files
from pipeline.shards.publish import collect_garbage, fresh_prefix, published_prefix, remove_unreported

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


def _shards_from_files(root: str, split: str, num_shards: int, files: list[dict],
                       sizes: dict[str, int]) -> SplitShards:
    """`root`: the filesystem path the writers wrote under; `sizes`: one listing of it (fs path -> bytes)."""
    by_shard: dict[int, list[ShardFile]] = {i: [] for i in range(num_shards)}
    for f in sorted(files, key=lambda f: f["path"]):
        if f["split"] != split:
            continue
        by_shard[f["shard"]].append(ShardFile(path=f["path"][len(root) + 1:], rows=f["rows"],
                                              bytes=sizes[f["path"]], row_groups=tuple(f["row_groups"])))
    shards = [Shard(index=i, rows=sum(f.rows for f in fs), files=tuple(fs)) for i, fs in by_shard.items()]
    return SplitShards(rows=sum(s.rows for s in shards), shards=tuple(shards))


def _write_vocabularies(root: str, vocabularies: Mapping[str, Any]) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = []
    for relative, values in sorted(vocabularies.items()):
        fs, path = storage.resolve(storage.join(root, relative))
        storage.ensure_dir(fs, os.path.dirname(path))
        pq.write_table(pa.table({"value": pa.array(values, pa.string())}), path, compression="zstd", filesystem=fs)
        written.append(relative)
    return written


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
    executor: a local path in local mode, a shared mount (NFS, /dbfs), or an object-store URL (s3://...).

    `features` are the fitted FeatureSpec dicts; `vocabularies` maps a FeatureSpec.vocabulary path
    (relative to the shard set) to its values (an Arrow string array), written as one-column Parquet files
    inside the set and covered by its fingerprint.
    """
    from udfs.shard_writer import FILES_SCHEMA_DDL, make_write_fn

    remote = storage.is_remote(target)
    if remote:
        target, prefix = str(target).rstrip("/"), fresh_prefix()
        root = storage.join(target, prefix)
        previous = published_prefix(target)
    else:
        target, prefix = Path(target).absolute(), ""
        target.parent.mkdir(parents=True, exist_ok=True)
        root = staging = staging_dir(target)
    fs, root_path = storage.resolve(root)
    published = False
    try:
        if not remote:
            staging.mkdir()
        write = make_write_fn(pack, root_path, rows_per_row_group, rows_per_file, fs if remote else None)
        files = [row.asDict() for row in df.mapInArrow(write, FILES_SCHEMA_DDL).collect()]
        removed = remove_unreported(str(root), {f["path"] for f in files})
        if removed:
            log.info("removed %d file(s) left by failed or duplicate task attempts", removed)
        sizes = storage.list_files(root)
        splits = {split: _shards_from_files(root_path, split, num_shards[split], files, sizes) for split in SPLITS}
        for split, info in splits.items():
            counts = [s.rows for s in info.shards]
            if counts and max(counts) - min(counts) > 1:
                raise DataError(f"internal: {split} shards are unbalanced {counts}; please report this")
        header = {"feature_columns": list(feature_columns), "label_mapping": list(label_mapping or []),
                  "means": list(means), "stds": list(stds), "task": task}
        if features:
            header["features"] = list(features)
        files = [f.path for info in splits.values() for s in info.shards for f in s.files]
        files += _write_vocabularies(str(root), vocabularies or {})
        manifest = Manifest(
            name=name, task=task, feature_columns=tuple(feature_columns), label_column=label_column,
            label_mapping=tuple(label_mapping) if label_mapping is not None else None,
            standardized=standardized, means=tuple(means), stds=tuple(stds), splits=splits,
            fingerprint=fingerprint_files(root, files, header), etl_report=dict(etl_report),
            features=tuple(features), data_prefix=prefix)
        if remote:
            manifest.write(target)  # the publish: readers switch to the new set here
        else:
            manifest.write(staging)
            commit(staging, target)
        published = True
    finally:
        if not remote:
            shutil.rmtree(staging, ignore_errors=True)
        elif not published:
            storage.delete_dir(root)  # best effort; a killed ETL's prefix goes with the next publish
    if remote:
        collect_garbage(target, prefix, keep=previous)
    log.info("committed shard set %s: %s", target,
             ", ".join(f"{k} {v.rows} rows in {len(v.shards)} shards" for k, v in manifest.splits.items()))
    return dataclasses.replace(manifest, root=str(target))
