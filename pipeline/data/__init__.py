"""Parquet shards -> torch batches for one rank (no Spark)."""
from pipeline.data.loader import read_tensors
from pipeline.data.stream import StreamingLoader

__all__ = ["StreamingLoader", "read_tensors"]
