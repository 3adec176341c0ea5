"""Shard files -> torch batches for one rank, streamed a row group at a time with bounded memory.

Arrow reader (the default): every rank is handed all train files and reads its part of the epoch's
global row stream (pipeline.data.assignment: row groups in a seeded order, rows permuted within windows
of data.shuffle_buffer_rows rows, the stream cut into one contiguous part per rank), so which rows a
rank trains on follows from (seed, epoch, world size) alone and a resumed run may have another world
size. Row groups are decoded ahead by reader threads (pipeline.data.planned) -> exactly
`steps_per_epoch` batches whose sizes differ by at most one -> a bounded queue filled by a prefetch
thread -> the caller. A batch is (inputs, labels): inputs the dict of tensors described in
pipeline.config.feature_spec (`numeric`, then one entry per other feature). Memory is
O(window + row group x (reader_threads + 2) + batch x prefetch x 16), whatever the shard size (batches
are handed over in lists of up to 16, mostly views of the window they were cut from).

Petastorm reader (the LTS lane): the rank's own shard files through a fixed-size shuffle buffer, as
before; it cannot change world size on resume.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator, Optional, Sequence

from pipeline.data.assignment import Segment, cut, epoch_windows, pieces, position, span, take
from pipeline.data.rowgroups import RowGroup, batch_sizes, epoch_rng, row_groups

log = logging.getLogger(__name__)
# Parquet files each reader thread keeps open (a shuffled epoch returns to a file: its footer is not re-read).
OPEN_FILES_PER_THREAD = 4

_DONE = object()
READERS = ("arrow", "petastorm")


class StreamingLoader:
    """Yields exactly `steps_per_epoch` batches per epoch covering every row of rank `rank`'s part once.

    Arrow: `files` are all the train files; rank `rank` of `world` reads part `rank` of each epoch's
    stream (seeded by (seed, epoch): reproducible, different per epoch; `shuffle=False` keeps file order).
    `resumed` is the segment of a resumed epoch (what an interrupted run left of it, maybe under another
    world size). Petastorm: `files` are the rank's own shard files, shuffled by (seed, rank, epoch).
    """

    def __init__(self, files: Sequence[str], *, steps_per_epoch: int, seed: int, rank: int,
                 features_field: str = "features", label_field: str = "label", num_features: Optional[int] = None,
                 row_group_rows: Optional[Sequence[Sequence[int]]] = None, shuffle: bool = True,
                 shuffle_buffer_rows: int = 65_536, prefetch: int = 2, reader_threads: int = 1,
                 reader: str = "arrow", pin_memory: Optional[bool] = None, features=None, world: Optional[int] = None,
                 resumed: Optional[Segment] = None):
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
        self.total_rows = sum(g.rows for g in self.groups)
        if world is not None and not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        if reader == "petastorm" and resumed is not None:
            raise DataError("data.reader=petastorm reads each rank's own shard files: a run cannot resume with "
                            "another parallelism.data (or mid-epoch on a new layout); set data.reader=arrow, or "
                            "resume with the parallelism.data the run started with")
        # world None: `files` are this rank's alone (a caller that already split them): the whole stream is
        # its part, seeded by rank too so ranks differ.
        self.world, self.resumed = world or 1, resumed
        self.steps_per_epoch = steps_per_epoch
        self.seed, self.rank = seed, rank
        self._part = rank if world is not None else 0
        self._stream_seed = seed if world is not None else [seed % 2**64, rank]
        # Rows of this rank in a whole epoch (arrow: its part of the stream; petastorm: its files).
        self.num_rows = (self.total_rows if reader == "petastorm"
                         else span(cut(((0, self.total_rows),), self.world)[self._part]))
        if self.num_rows < steps_per_epoch:
            raise DataError(f"rank {rank} holds {self.num_rows} rows, fewer than the {steps_per_epoch} steps per "
                            "epoch; lower train.batch_size's effect or use fewer workers")
        self.features_field, self.label_field = features_field, label_field
        self.num_features = num_features
        self.shuffle = shuffle
        self.shuffle_buffer_rows = max(1, shuffle_buffer_rows)
        self.prefetch = max(0, prefetch)
        self.reader_threads = max(1, reader_threads)
        self.reader = reader
        self.pin_memory = pin_memory
        # Largest shuffle-buffer fill (petastorm) or shuffle window (arrow) seen, for memory tests and logs.
        self.peak_buffered_rows = 0
        self._sizes = batch_sizes(self.num_rows, steps_per_epoch)
        if reader == "petastorm":
            from pipeline.data.petastorm_source import check_petastorm

            check_petastorm()

    def __len__(self) -> int:
        return self.steps_per_epoch

    # -- the arrow reader: this rank's part of the epoch's global row stream (pipeline.data.assignment) --
    def segment(self, epoch: int) -> Segment:
        """What this loader's ranks read in ``epoch``: the resumed segment, or the whole stream."""
        return position(self.resumed, epoch, self.total_rows, self.world)

    def part(self, epoch: int) -> tuple:
        """This rank's stream intervals in ``epoch``."""
        return cut(self.segment(epoch).intervals, self.segment(epoch).world)[self._part]

    def _read_group(self):
        from pipeline.data.arrow_read import read_row_group
        from pipeline.errors import DataError
        from pipeline.storage import open_parquet

        local = threading.local()

        def read(index: int):
            group = self.groups[index]
            files = local.__dict__.setdefault("files", {})  # open ParquetFiles of this thread, oldest first
            if group.path not in files:
                # An open pre-buffered file (object stores) keeps its last row group's bytes: kept open for
                # the epoch, every file held one (a rank reached the compressed split / ranks), so only the
                # few newest stay open.
                while len(files) >= OPEN_FILES_PER_THREAD:
                    files.pop(next(iter(files)))
                files[group.path] = open_parquet(group.path)  # object stores: ranged reads, pre-buffered
            features, labels = read_row_group(files[group.path], group.path, group.index, self.features_field,
                                              self.label_field, self.num_features, self.features)
            if len(labels) != group.rows:
                raise DataError(f"{group.path} row group {group.index} has {len(labels)} rows, its footer or the "
                                f"manifest says {group.rows}; re-run `shardline etl`")
            return features, labels

        return read

    def _planned_batches(self, epoch: int, stop: threading.Event, start_step: int) -> Iterator[tuple]:
        import torch

        from pipeline.data.planned import planned_chunks, sized_batches

        segment = self.segment(epoch)
        if start_step < segment.base:
            raise ValueError(f"internal: epoch {epoch} resumes at batch {segment.base}, asked for {start_step}")
        mine = self.part(epoch)
        sizes = batch_sizes(span(mine), self.steps_per_epoch - segment.base)
        done = start_step - segment.base
        unread = take(mine, sum(sizes[:done]), sum(sizes[done:]))
        windows = epoch_windows([g.rows for g in self.groups], self._stream_seed, epoch, self.shuffle_buffer_rows,
                                self.shuffle)
        self.peak_buffered_rows = max([self.peak_buffered_rows] + [w.rows for w in windows])
        chunks = planned_chunks(windows, pieces(windows, unread), self._read_group(), seed=self._stream_seed, epoch=epoch,
                                shuffle=self.shuffle, threads=self.reader_threads, ahead=self.prefetch > 0,
                                stop=stop, name=f"read-rank{self.rank}")
        pin = self.pin_memory if self.pin_memory is not None else torch.cuda.is_available()
        yield from sized_batches(chunks, sizes[done:], pin)

    # -- the petastorm reader: this rank's own shard files through the shuffle buffer ----------------
    def _chunks(self, epoch: int, stop: threading.Event) -> Iterator[tuple]:
        from pipeline.data.petastorm_source import petastorm_chunks

        chunks = petastorm_chunks(self.files, self.features_field, self.label_field, self.num_features,
                                  seed=self.seed, rank=self.rank, epoch=epoch, shuffle=self.shuffle,
                                  workers=self.reader_threads)
        return (({"numeric": x}, y) for x, y in chunks)

    # -- batches ------------------------------------------------------------------------------------
    def _batches(self, epoch: int, stop: threading.Event, start_step: int = 0) -> Iterator[tuple]:
        """The epoch's batches. Rows leave the shuffle buffer in blocks (every row beyond its capacity at
        once: one vectorised random gather per row group, not one per batch) into an ordered row stream;
        batches are consecutive slices of that stream, handed to torch without copying."""
        import torch

        from pipeline.data.row_queue import RowQueue
        from pipeline.data.shuffle import ShuffleBuffer
        from pipeline.errors import DataError

        sizes = self._sizes
        largest_group = max(g.rows for g in self.groups)
        # Without shuffling the buffer only has to hold one batch; with it, shuffle_buffer_rows.
        capacity = max(self.shuffle_buffer_rows, sizes[0]) if self.shuffle else sizes[0]
        rng = epoch_rng(self.seed, self.rank, epoch) if self.shuffle else None
        buffer: Optional[ShuffleBuffer] = None
        pin = self.pin_memory if self.pin_memory is not None else torch.cuda.is_available()
        queue = RowQueue(pin)  # blocks taken from the buffer, in epoch order
        step, seen = 0, 0

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
                    queue.append(buffer.take(len(buffer) - capacity))
                    while step < len(sizes) and queue.rows >= sizes[step]:
                        if step >= start_step:
                            yield queue.cut(sizes[step])
                        else:
                            queue.cut(sizes[step], keep=False)
                        step += 1
            del features, labels
            self.peak_buffered_rows = max(self.peak_buffered_rows, buffer.peak_rows)
            if stop.is_set():
                return
        if seen != self.num_rows:
            raise DataError(f"rank {self.rank}: read {seen} rows from {len(self.files)} shard file(s), their "
                            f"footers/manifest say {self.num_rows}; re-run `shardline etl`")
        if buffer is not None and len(buffer):
            queue.append(buffer.take(len(buffer)))
        while step < len(sizes):
            if step >= start_step:
                yield queue.cut(sizes[step])
            else:
                queue.cut(sizes[step], keep=False)
            step += 1

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple]:
        """The batches of one epoch; with prefetch > 0 they are assembled in a background thread.

        start_step > 0 resumes an epoch: batch start_step comes first. Arrow: the stream positions of the
        batches before it are known, so they are skipped unread; petastorm: they are read and dropped (the
        shuffle is seeded per epoch, so they are exactly the batches already trained on)."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step must be in [0, {self.steps_per_epoch}], got {start_step}")
        stop = threading.Event()
        batches = self._batches if self.reader == "petastorm" else self._planned_batches
        if self.prefetch == 0:
            yield from batches(epoch, stop, start_step)
            return
        yield from _prefetched(lambda: batches(epoch, stop, start_step), self.prefetch, stop,
                               name=f"prefetch-rank{self.rank}-epoch{epoch}")


# Batches go to the consumer in lists of up to this many: a queue hand-off costs ~5-10 us on each side,
# as much as cutting the batch itself, so one per batch of 256 rows was a tenth of the loader's CPU
# (bench/loader_bench.py). A list goes at once whenever the consumer has nothing waiting.
_HANDOFF_ITEMS = 16


def _prefetched(make: Callable[[], Iterator], depth: int, stop: threading.Event, name: str) -> Iterator:
    """Run `make()` in a thread feeding a queue of `depth` lists of items; errors surface in the caller."""
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
        pending: list = []
        try:
            for item in make():
                pending.append(item)
                if len(pending) >= _HANDOFF_ITEMS or ready.empty():
                    if not put(pending):
                        return
                    pending = []
            if pending and not put(pending):
                return
            put(_DONE)
        except BaseException as exc:  # surfaced in the consumer thread, after the items before it
            if pending and not put(pending):
                return
            put(exc)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            items = ready.get()
            if items is _DONE:
                return
            if isinstance(items, BaseException):
                raise items
            yield from items
    finally:
        stop.set()
        thread.join(timeout=10)
