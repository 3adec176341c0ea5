"""A rank's read plan: its Parquet row groups, their order each epoch, and the sizes of its batches.

Everything here comes from Parquet footers (or the manifest's counts), never from the data itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int  # row group number within the file
    rows: int


def row_groups(files: Sequence[str], counts: Optional[Sequence[Sequence[int]]] = None) -> list[RowGroup]:
    """Every row group of `files`; `counts[i]` (per-row-group rows of file i, e.g. from the manifest)
    saves opening the footers."""
    import pyarrow as pa

    from pipeline.errors import DataError, shard_read_error
    from pipeline.storage import open_parquet

    if not files:
        raise DataError("no shard files to read for this rank")
    groups: list[RowGroup] = []
    for i, path in enumerate(files):
        if counts is not None and i < len(counts) and counts[i]:
            groups += [RowGroup(path, g, int(rows)) for g, rows in enumerate(counts[i])]
            continue
        try:
            metadata = open_parquet(path).metadata
        except (pa.ArrowInvalid, OSError) as exc:
            raise shard_read_error(f"cannot read shard file {path}: {exc}; re-run `shardline etl`", exc) from None
        groups += [RowGroup(path, g, metadata.row_group(g).num_rows) for g in range(metadata.num_row_groups)]
    return [g for g in groups if g.rows > 0]


def batch_sizes(total_rows: int, steps: int) -> list[int]:
    """`steps` batch sizes covering `total_rows` exactly, differing by at most one (larger ones first)."""
    base, extra = divmod(total_rows, steps)
    return [base + 1] * extra + [base] * (steps - extra)


def epoch_rng(seed: int, rank: int, epoch: int):
    """The same (seed, rank, epoch) gives the same stream on every machine and process."""
    import numpy as np

    return np.random.default_rng(np.random.SeedSequence([seed % 2**64, rank, epoch]))
