"""One rank's shard files -> torch batches: pyarrow straight to tensors, seeded shuffle, prefetch thread.

No Spark and no pandas: the features column (a list<float> column) is one flat float32 buffer in
Arrow, viewed as an (rows, features) numpy array and handed to torch without a copy.
"""
from __future__ import annotations

import logging
import queue
import threading
import warnings
from typing import Iterator, Sequence

log = logging.getLogger(__name__)

_DONE = object()


def read_tensors(files: Sequence[str], features_field: str = "features", label_field: str = "label",
                 num_features: int | None = None):
    """Read Parquet shard files into (features float32 [n, d], labels) tensors."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline.errors import DataError

    if not files:
        raise DataError("no shard files to read for this rank")
    tables = []
    for path in files:
        try:
            tables.append(pq.read_table(path, columns=[features_field, label_field]))
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            raise DataError(f"cannot read shard file {path}: {exc}; re-run `shardline etl`") from None
    table = pa.concat_tables(tables)
    rows = table.num_rows
    column = table.column(features_field).combine_chunks()
    flat = column.flatten() if rows else pa.array([], pa.float32())
    values = flat.to_numpy(zero_copy_only=False)
    width = num_features if num_features is not None else (len(values) // rows if rows else 0)
    if rows and len(values) != rows * width:
        raise DataError(f"shard files {list(files)} hold feature vectors of uneven length "
                        f"({len(values)} values for {rows} rows x {width} features); re-run `shardline etl`")
    with warnings.catch_warnings():
        # Arrow buffers are read-only; batches are gathered with index_select (a copy), never written in place.
        warnings.simplefilter("ignore", UserWarning)
        features = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, width))
    label_array = table.column(label_field).combine_chunks().to_numpy(zero_copy_only=False)
    labels = torch.from_numpy(np.ascontiguousarray(label_array))
    if labels.dtype == torch.float64:
        labels = labels.to(torch.float32)
    return features, labels


class ShardLoader:
    """Yields exactly `steps_per_epoch` batches per epoch covering every row of the rank once.

    Rows are permuted by a generator seeded with (seed, rank, epoch) — reproducible, different per
    epoch and per rank — and split into `steps_per_epoch` batches whose sizes differ by at most one.
    """

    def __init__(self, features, labels, *, steps_per_epoch: int, seed: int, rank: int, prefetch: int = 2,
                 shuffle: bool = True):
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        if len(features) < steps_per_epoch:
            from pipeline.errors import DataError

            raise DataError(f"rank {rank} holds {len(features)} rows, fewer than the {steps_per_epoch} steps per "
                            "epoch; lower train.batch_size's effect or use fewer workers")
        self.features = features
        self.labels = labels
        self.steps_per_epoch = steps_per_epoch
        self.seed = seed
        self.rank = rank
        self.prefetch = prefetch
        self.shuffle = shuffle

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _order(self, epoch: int):
        import torch

        if not self.shuffle:
            return torch.arange(len(self.features))
        # A fixed mix of (seed, rank, epoch): the same on every machine and Python process.
        mixed = ((self.seed * 1_000_003 + self.rank) * 1_000_003 + epoch) % (2**63)
        generator = torch.Generator().manual_seed(mixed)
        return torch.randperm(len(self.features), generator=generator)

    def _batches(self, epoch: int) -> Iterator[tuple]:
        for index in self._order(epoch).tensor_split(self.steps_per_epoch):
            yield self.features.index_select(0, index), self.labels.index_select(0, index)

    def epoch(self, epoch: int) -> Iterator[tuple]:
        """The batches of one epoch; with prefetch > 0 they are gathered in a background thread."""
        if self.prefetch == 0:
            yield from self._batches(epoch)
            return
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            try:
                for batch in self._batches(epoch):
                    while not stop.is_set():
                        try:
                            ready.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                ready.put(_DONE)
            except BaseException as exc:  # surfaced in the consumer thread
                ready.put(exc)

        thread = threading.Thread(target=produce, name=f"prefetch-rank{self.rank}-epoch{epoch}", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=5)
