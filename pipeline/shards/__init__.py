"""Shard sets: writing balanced Parquet shards + manifest (atomic), reading manifests, per-rank plans."""
from pipeline.shards.manifest import MANIFEST_NAME, Manifest, Shard, ShardFile, SplitShards, load_manifest
from pipeline.shards.plan import rank_files, steps_per_epoch

__all__ = ["MANIFEST_NAME", "Manifest", "Shard", "ShardFile", "SplitShards", "load_manifest",
           "rank_files", "steps_per_epoch"]
