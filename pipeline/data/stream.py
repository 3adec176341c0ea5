"""One rank's shard files -> torch batches, streamed a row group at a time with bounded memory.

Per epoch: row groups in a seeded random order -> decoded ahead by reader threads (a bounded window)
-> a fixed-size shuffle buffer, which hands every row beyond its capacity on as one randomly ordered
block per row group (a single vectorised gather) -> exactly `steps_per_epoch` batches whose sizes differ
by at most one, zero-copy slices of those blocks, covering every row of the rank once -> a bounded queue
filled by a prefetch thread -> the caller. A batch is (inputs, labels): inputs the dict of tensors
described in pipeline.config.feature_spec (`numeric`, then one entry per other feature).
Memory is O(shuffle_buffer_rows + row group x (reader_threads + 2) + batch x prefetch), whatever the
shard size.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

from pipeline.data.rowgroups import RowGroup, batch_sizes, epoch_rng, row_groups

log = logging.getLogger(__name__)

_DONE = object()
READERS = ("arrow", "petastorm")


class StreamingLoader:
    """Yields exactly `steps_per_epoch` batches per epoch covering every row of the rank's files once.

    The row-group order and the shuffle buffer are seeded by (seed, rank, epoch): reproducible,
    different per epoch and per rank. `shuffle=False` reads the files in order.
    """

    def __init__(self, files: Sequence[str], *, steps_per_epoch: int, seed: int, rank: int,
                 features_field: str = "features", label_field: str = "label", num_features: Optional[int] = None,
                 row_group_rows: Optional[Sequence[Sequence[int]]] = None, shuffle: bool = True,
                 shuffle_buffer_rows: int = 65_536, prefetch: int = 2, reader_threads: int = 1,
                 reader: str = "arrow", pin_memory: Optional[bool] = None, features=None):
        from pipeline.errors import DataError

        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        if reader not in READERS:
            raise DataError(f"data.reader={reader!r} is not one of {READERS}")
        if features is not None and reader == "petastorm" and not features.only_numeric:
            others = [f"{f.name} ({f.type})" for f in features if f.type != "numeric"]
            raise DataError(f"data.reader=petastorm serves numeric features only; this shard set also has {others}: "
                            "set data.reader=arrow (shardline's reader serves every feature type)")
        self.features = features  # a FeatureSet (None: the classic packed numeric block)
        self.files = list(files)
        self.groups: list[RowGroup] = row_groups(self.files, row_group_rows)
        self.num_rows = sum(g.rows for g in self.groups)
        if self.num_rows < steps_per_epoch:
            raise DataError(f"rank {rank} holds {self.num_rows} rows, fewer than the {steps_per_epoch} steps per "
                            "epoch; lower train.batch_size's effect or use fewer workers")
        self.steps_per_epoch = steps_per_epoch
        self.seed, self.rank = seed, rank
        self.features_field, self.label_field = features_field, label_field
        self.num_features = num_features
        self.shuffle = shuffle
        self.shuffle_buffer_rows = max(1, shuffle_buffer_rows)
        self.prefetch = max(0, prefetch)
        self.reader_threads = max(1, reader_threads)
        self.reader = reader
        self.pin_memory = pin_memory
        self.peak_buffered_rows = 0  # largest shuffle-buffer fill seen (for memory tests and logs)
        self._sizes = batch_sizes(self.num_rows, steps_per_epoch)
        if reader == "petastorm":
            from pipeline.data.petastorm_source import check_petastorm

            check_petastorm()

    def __len__(self) -> int:
        return self.steps_per_epoch

    # -- sources of (features, labels) chunks, in epoch order ---------------------------------------
    def _arrow_chunks(self, epoch: int, stop: threading.Event) -> Iterator[tuple]:
        from pipeline.data.arrow_read import read_row_group
        from pipeline.errors import DataError
        from pipeline.storage import open_parquet

        order = list(self.groups)
        if self.shuffle:
            order = [order[i] for i in epoch_rng(self.seed, self.rank, epoch).permutation(len(order))]
        local = threading.local()

        def read(group: RowGroup):
            files = local.__dict__.setdefault("files", {})  # one open ParquetFile per file per thread
            if group.path not in files:
                files[group.path] = open_parquet(group.path)  # object stores: ranged reads, pre-buffered
            features, labels = read_row_group(files[group.path], group.path, group.index, self.features_field,
                                              self.label_field, self.num_features, self.features)
            if len(labels) != group.rows:
                raise DataError(f"{group.path} row group {group.index} has {len(labels)} rows, its footer or the "
                                f"manifest says {group.rows}; re-run `shardline etl`")
            return features, labels

        if self.prefetch == 0 and self.reader_threads == 1:
            for group in order:
                yield read(group)
            return
        from concurrent.futures import ThreadPoolExecutor

        # Reads are submitted in order into a window of reader_threads + 1 and consumed in order:
        # parallel decoding (pyarrow releases the GIL) with a deterministic, bounded stream.
        window: deque = deque()
        pool = ThreadPoolExecutor(self.reader_threads, thread_name_prefix=f"read-rank{self.rank}")
        try:
            pending = iter(order)
            for group in pending:
                window.append(pool.submit(read, group))
                if len(window) > self.reader_threads:
                    break
            while window and not stop.is_set():
                chunk = window.popleft().result()
                nxt = next(pending, None)
                if nxt is not None:
                    window.append(pool.submit(read, nxt))
                yield chunk
        finally:
            for future in window:
                future.cancel()
            pool.shutdown(wait=True)

    def _chunks(self, epoch: int, stop: threading.Event) -> Iterator[tuple]:
        if self.reader == "petastorm":
            from pipeline.data.petastorm_source import petastorm_chunks

            chunks = petastorm_chunks(self.files, self.features_field, self.label_field, self.num_features,
                                      seed=self.seed, rank=self.rank, epoch=epoch, shuffle=self.shuffle,
                                      workers=self.reader_threads)
            return (({"numeric": x}, y) for x, y in chunks)
        return self._arrow_chunks(epoch, stop)

    # -- batches ------------------------------------------------------------------------------------
    def _batches(self, epoch: int, stop: threading.Event, start_step: int = 0) -> Iterator[tuple]:
        """The epoch's batches. Rows leave the shuffle buffer in blocks (every row beyond its capacity at
        once: one vectorised random gather per row group, not one per batch) into an ordered row stream;
        batches are consecutive slices of that stream, handed to torch without copying."""
        import numpy as np
        import torch

        from pipeline.data.shuffle import ShuffleBuffer
        from pipeline.errors import DataError

        sizes = self._sizes
        largest_group = max(g.rows for g in self.groups)
        # Without shuffling the buffer only has to hold one batch; with it, shuffle_buffer_rows.
        capacity = max(self.shuffle_buffer_rows, sizes[0]) if self.shuffle else sizes[0]
        rng = epoch_rng(self.seed, self.rank, epoch) if self.shuffle else None
        buffer: Optional[ShuffleBuffer] = None
        pin = self.pin_memory if self.pin_memory is not None else torch.cuda.is_available()
        stream: deque = deque()  # (features, labels) blocks taken from the buffer, in epoch order
        streamed = 0  # rows in `stream`
        step, seen = 0, 0

        def cut(size: int, keep: bool = True):
            """The next `size` rows of the stream: a view of one block, or (straddling) a small concatenation.
            With keep=False the rows are only dropped (a resumed epoch skipping its applied steps)."""
            nonlocal streamed
            xs, ys, need = [], [], size
            while need:
                x, y = stream[0]
                if len(y) <= need:
                    stream.popleft()
                else:
                    stream[0] = ({key: value[need:] for key, value in x.items()}, y[need:])
                    x, y = {key: value[:need] for key, value in x.items()}, y[:need]
                xs.append(x)
                ys.append(y)
                need -= len(y)
            streamed -= size
            if not keep:
                return None
            if len(xs) == 1:
                x, y = xs[0], ys[0]
            else:
                x, y = {key: np.concatenate([part[key] for part in xs]) for key in xs[0]}, np.concatenate(ys)
            x, y = {key: torch.from_numpy(value) for key, value in x.items()}, torch.from_numpy(y)
            if pin:
                return {key: value.pin_memory() for key, value in x.items()}, y.pin_memory()
            return x, y

        for features, labels in self._chunks(epoch, stop):
            if buffer is None:
                # Sized once: a chunk arrives only while the buffer is at or below capacity.
                layout = {key: (value.shape[1:], value.dtype) for key, value in features.items()}
                buffer = ShuffleBuffer(capacity + max(largest_group, len(labels)), layout, labels.dtype, rng)
            seen += len(labels)
            if seen > self.num_rows:
                raise DataError(f"rank {self.rank}: the shard files hold more rows than their footers/manifest "
                                f"say ({self.num_rows}); re-run `shardline etl`")
            # Added in pieces that fit: after taking, the buffer holds at most `capacity` rows.
            offset = 0
            while offset < len(labels):
                piece = min(buffer.slots - len(buffer), len(labels) - offset)
                buffer.add({key: value[offset:offset + piece] for key, value in features.items()},
                           labels[offset:offset + piece])
                offset += piece
                if len(buffer) > capacity:
                    block = buffer.take(len(buffer) - capacity)
                    stream.append(block)
                    streamed += len(block[1])
                    while step < len(sizes) and streamed >= sizes[step]:
                        if step >= start_step:
                            yield cut(sizes[step])
                        else:
                            cut(sizes[step], keep=False)
                        step += 1
            del features, labels
            self.peak_buffered_rows = max(self.peak_buffered_rows, buffer.peak_rows)
            if stop.is_set():
                return
        if seen != self.num_rows:
            raise DataError(f"rank {self.rank}: read {seen} rows from {len(self.files)} shard file(s), their "
                            f"footers/manifest say {self.num_rows}; re-run `shardline etl`")
        if buffer is not None and len(buffer):
            block = buffer.take(len(buffer))
            stream.append(block)
            streamed += len(block[1])
        while step < len(sizes):
            if step >= start_step:
                yield cut(sizes[step])
            else:
                cut(sizes[step], keep=False)
            step += 1

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple]:
        """The batches of one epoch; with prefetch > 0 they are assembled in a background thread.

        start_step > 0 resumes an epoch: the first start_step batches are read and dropped (the shuffle is
        seeded per epoch, so they are exactly the batches already trained on) and batch start_step comes
        first."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step must be in [0, {self.steps_per_epoch}], got {start_step}")
        stop = threading.Event()
        if self.prefetch == 0:
            yield from self._batches(epoch, stop, start_step)
            return
        yield from _prefetched(lambda: self._batches(epoch, stop, start_step), self.prefetch, stop,
                               name=f"prefetch-rank{self.rank}-epoch{epoch}")


def _prefetched(make: Callable[[], Iterator], depth: int, stop: threading.Event, name: str) -> Iterator:
    """Run `make()` in a thread feeding a queue of `depth` items; errors surface in the caller."""
    ready: queue.Queue = queue.Queue(maxsize=depth)

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in make():
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # surfaced in the consumer thread
            put(exc)

    thread = threading.Thread(target=produce, name=name, daemon=True)
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
        thread.join(timeout=10)
