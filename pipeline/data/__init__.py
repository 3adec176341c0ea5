"""Parquet shards -> torch batches for one rank (no Spark)."""
from pipeline.data.loader import ShardLoader, read_tensors

__all__ = ["ShardLoader", "read_tensors"]
