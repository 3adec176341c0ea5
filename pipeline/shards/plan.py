"""Per-rank work plans, computed on the driver from the manifest alone (no data is read)."""
from __future__ import annotations

import math

from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest


def steps_per_epoch(manifest: Manifest, world_size: int, batch_size: int, *, per_rank_shards: bool = False) -> int:
    """Every rank must run the same number of synchronous steps, so the smallest part decides.

    The arrow reader cuts each epoch's global row stream into ``world_size`` parts of equal size (±1,
    pipeline.data.assignment), whatever the number of shard files; ``per_rank_shards`` (the petastorm
    reader) reads shard r on rank r, so the shard count must equal the world size and the smallest shard
    decides. Each rank splits its rows into exactly this many batches (sizes differ by at most one), so
    every row is still seen once per epoch even on the ranks holding one extra row.
    """
    train = manifest.split("train")
    if per_rank_shards and len(train.shards) != world_size:
        raise DataError(f"the shard set at {manifest.root} has {len(train.shards)} train shards but "
                        f"parallelism.data={world_size}, and data.reader=petastorm reads one shard per worker; "
                        "re-run `shardline etl` with the same parallelism.data, or set data.reader=arrow")
    smallest = min(s.rows for s in train.shards) if per_rank_shards else train.rows // world_size
    if smallest < batch_size:
        # Every worker needs one full batch per step; the ETL checks this too, but an older shard set (or
        # a larger batch_size or more workers than the ETL ran with) can still fall short.
        raise DataError(
            f"the shard set at {manifest.root} has {train.rows} train rows for {world_size} workers (smallest "
            f"{'shard' if per_rank_shards else 'part'}: {smallest} rows), fewer than one batch per worker: "
            f"train.batch_size={batch_size} x parallelism.data={world_size} = {batch_size * world_size} rows; use a "
            "smaller train.batch_size, fewer workers (parallelism.data), or re-run `shardline etl` with more data")
    return math.ceil(smallest / batch_size)


def rank_files(manifest: Manifest, rank: int) -> list[str]:
    return manifest.files("train", rank)

