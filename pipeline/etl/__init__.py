"""Spark ETL: sources, cleaning, deterministic split, train-only statistics, shard writing."""
from pipeline.etl.run import run_etl, shards_dir

__all__ = ["run_etl", "shards_dir"]
