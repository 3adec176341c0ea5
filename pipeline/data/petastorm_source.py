"""The petastorm backend (`data.reader: petastorm`): row groups decoded by petastorm's make_batch_reader.

Optional: installed with the `petastorm` extra on the LTS stack (petastorm 0.12.1 needs pyarrow <= 14.0.2
and numpy < 2; see constraints/lts.txt), imported only when chosen. Its chunks feed the same shuffle
buffer and batch plan as the arrow backend, so a rank still runs exactly steps_per_epoch batches.
"""
from __future__ import annotations

import logging
import os
from typing import Iterator, Optional, Sequence

log = logging.getLogger(__name__)

MAX_PYARROW_MAJOR = 14


def _major(version: str) -> int:
    return int(version.split(".")[0])


def check_petastorm() -> None:
    """Fail early, saying what to install, when petastorm is missing or cannot work with this pyarrow/numpy."""
    import numpy as np
    import pyarrow as pa

    from pipeline.errors import DataError

    install = ("install the LTS stack: pip install -c constraints/lts.txt 'shardline[petastorm]' "
               "(or `make lts`), or set data.reader=arrow")
    if _major(pa.__version__) > MAX_PYARROW_MAJOR or _major(np.__version__) >= 2:
        raise DataError(f"data.reader=petastorm needs pyarrow <= 14.0.2 and numpy < 2 (petastorm 0.12), but "
                        f"pyarrow {pa.__version__} and numpy {np.__version__} are installed; {install}")
    import warnings

    # petastorm 0.12 uses pyarrow's legacy dataset API: one FutureWarning per row group otherwise.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")
    try:
        import petastorm  # noqa: F401
        from petastorm import make_batch_reader  # noqa: F401
    except ImportError as exc:
        raise DataError(f"data.reader=petastorm but petastorm cannot be imported ({exc}); {install}") from None


def petastorm_chunks(files: Sequence[str], features_field: str, label_field: str, width: Optional[int], *,
                     seed: int, rank: int, epoch: int, shuffle: bool, workers: int = 1,
                     shard: Optional[tuple[int, int]] = None) -> Iterator[tuple]:
    """(features float32 [n, width], labels) per row group read by petastorm.

    `shard=(cur_shard, shard_count)` hands row groups out with petastorm's own sharding (used when all
    ranks read one file list); the loader passes each rank its own shard files instead, so ranks keep
    the manifest's balanced row counts and the same number of steps.
    """
    import numpy as np
    from petastorm import make_batch_reader

    from pipeline.errors import DataError

    urls = ["file://" + os.path.abspath(f) if "://" not in f else f for f in files]
    cur_shard, shard_count = shard if shard is not None else (None, None)
    reader_seed = (seed * 1_000_003 + rank * 1_009 + epoch) % 2**32
    with make_batch_reader(urls, schema_fields=[features_field, label_field], num_epochs=1,
                           shuffle_row_groups=shuffle, seed=reader_seed, reader_pool_type="thread",
                           workers_count=workers, cur_shard=cur_shard, shard_count=shard_count) as reader:
        for batch in reader:
            features = getattr(batch, features_field)
            if features.dtype == object:  # a list column arrives as one array per row
                features = np.stack(features) if len(features) else np.empty((0, width or 0), np.float32)
            features = np.ascontiguousarray(features, dtype=np.float32)
            if width is not None and features.ndim == 2 and features.shape[1] != width:
                raise DataError(f"petastorm read {features.shape[1]} features per row from {urls[0]}..., the "
                                f"manifest says {width}; re-run `shardline etl`")
            labels = np.asarray(getattr(batch, label_field))
            if labels.dtype == np.float64:
                labels = labels.astype(np.float32)
            yield features, labels
