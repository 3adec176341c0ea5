"""Per-rank work plans, computed on the driver from the manifest alone (no data is read)."""
from __future__ import annotations

import math

from pipeline.errors import DataError
from pipeline.shards.manifest import Manifest


def steps_per_epoch(manifest: Manifest, world_size: int, batch_size: int) -> int:
    """Every rank must run the same number of synchronous steps, so the smallest shard decides.

    Each rank splits its rows into exactly this many batches (sizes differ by at most one), so every
    row is still seen once per epoch even on the ranks holding one extra row.
    """
    train = manifest.split("train")
    if len(train.shards) != world_size:
        raise DataError(f"the shard set at {manifest.root} has {len(train.shards)} train shards but "
                        f"parallelism.data={world_size}; re-run `shardline etl` with the same parallelism.data")
    smallest = min(s.rows for s in train.shards)
    if smallest == 0:
        raise DataError(f"train shard(s) of {manifest.root} are empty ({train.rows} train rows for {world_size} "
                        "workers); use fewer workers (parallelism.data) or more data")
    return math.ceil(smallest / batch_size)


def rank_files(manifest: Manifest, rank: int) -> list[str]:
    return manifest.files("train", rank)
