"""One shard set over several: the incremental workflow's partitions, each ETL'd once, trained on together."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Sequence

from pipeline.errors import ManifestError
from pipeline.shards.manifest import Manifest, Shard, ShardFile, SplitShards


def merge_manifests(parts: Sequence[Manifest], root: str | os.PathLike, name: str) -> Manifest:
    """A manifest at `root` listing every part's files (parts must live under `root`).

    Shard i of a split is shard i of every part: each part is balanced to within one row, so the merged
    shards are balanced to within one row per part. Parts must agree on features, labels and statistics
    (the workflow freezes them at its first partition)."""
    if not parts:
        raise ManifestError("no shard sets to merge")
    root = Path(root).absolute()
    first = parts[0]
    for part in parts[1:]:
        for field in ("task", "feature_columns", "label_mapping", "means", "stds", "standardized", "features"):
            if getattr(part, field) != getattr(first, field):
                raise ManifestError(f"shard set {part.root} differs from {first.root} in {field}; the "
                                    "partitions of one workflow must share features, labels and statistics")
    splits = {}
    for split in first.splits:
        width = max(len(p.split(split).shards) for p in parts)
        shards = []
        for index in range(width):
            files = []
            for part in parts:
                chosen = part.split(split).shards
                if index < len(chosen):
                    base = Path(part.root).absolute().relative_to(root)
                    files += [dataclasses.replace(f, path=str(base / f.path)) for f in chosen[index].files]
            shards.append(Shard(index=index, rows=sum(f.rows for f in files), files=tuple(files)))
        splits[split] = SplitShards(rows=sum(s.rows for s in shards), shards=tuple(shards))
    digest = hashlib.sha256("".join(sorted(p.fingerprint for p in parts)).encode()).hexdigest()
    # Vocabulary files stay in the first part (every part holds the same, frozen at the first partition).
    base = Path(first.root).absolute().relative_to(root)
    features = tuple({**f, "vocabulary": str(base / f["vocabulary"])} if f.get("vocabulary") else f
                     for f in first.features)
    merged = dataclasses.replace(first, name=name, splits=splits, fingerprint=f"sha256:{digest}",
                                 etl_report=_merged_report(parts), root=str(root), features=features)
    merged.write(root)
    return merged


def _merged_report(parts: Sequence[Manifest]) -> dict:
    """The parts, their rows, and (a Delta/Iceberg source) the newest table version among them: the version the
    merged set is up to, which the training run records as its input."""
    report: dict = {"parts": [p.root for p in parts],
                    "input_rows": sum(int(p.etl_report.get("input_rows") or 0) for p in parts)}
    tables = [p.etl_report["table"] for p in parts if p.etl_report.get("table")]
    if tables:
        report["table"] = tables[-1]
    return report
