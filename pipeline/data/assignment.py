"""Which rows each rank trains on, per epoch, independent of how many ranks there are (elastic resume).

Every epoch has one global row stream over all train row groups of all train files: the row groups in a
permutation seeded by (seed, epoch), taken in windows of consecutive groups holding at least
``window_rows`` rows (``data.shuffle_buffer_rows``), the rows of each window in a permutation seeded by
(seed, epoch, window). A position in [0, total_rows) of that stream names one row, on every machine.

What is left of an epoch is a list of position intervals (a ``Segment``: the whole stream for a fresh
epoch). A segment is cut into ``world`` contiguous parts of equal size (±1): rank r trains on part r, as
exactly ``steps`` batches whose sizes differ by at most one. After ``done`` steps every rank has consumed
the same-numbered prefix of its part, so the rest of the epoch is again a list of intervals — which a
resumed run with another world size cuts into its own parts. That is what makes every train row seen
exactly once per epoch across an N -> M resume (and N -> M -> K).

Plain numbers only (numpy for the permutations): the driver plans with it, the loader reads with it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

log = logging.getLogger(__name__)

Interval = tuple[int, int]


@dataclass(frozen=True)
class Segment:
    """The rows of epoch ``epoch`` still to train on (``intervals``: [start, end) stream positions), dealt to
    ``world`` ranks. ``base``: the epoch's steps counted before this segment, so a rank's step numbers keep
    ``epoch * steps_per_epoch + batch`` arithmetic and the segment holds ``steps_per_epoch - base`` batches."""

    epoch: int
    intervals: tuple[Interval, ...]
    world: int
    base: int = 0

    def record(self) -> dict:
        return {"epoch": self.epoch, "intervals": [list(i) for i in self.intervals], "world": self.world,
                "base": self.base}

    @classmethod
    def of(cls, record: dict) -> "Segment":
        return cls(int(record["epoch"]), tuple((int(a), int(b)) for a, b in record["intervals"]),
                   int(record["world"]), int(record.get("base", 0)))


def span(intervals: Sequence[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def even_sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes covering ``total`` exactly, differing by at most one (larger ones first)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def take(intervals: Sequence[Interval], start: int, count: int) -> tuple[Interval, ...]:
    """Positions ``start .. start + count`` of the concatenation of ``intervals``, as intervals."""
    out, skipped = [], 0
    for a, b in intervals:
        length = b - a
        lo, hi = max(start - skipped, 0), min(start + count - skipped, length)
        if lo < hi:
            out.append((a + lo, a + hi))
        skipped += length
        if skipped >= start + count:
            break
    return tuple(out)


def cut(intervals: Sequence[Interval], world: int) -> list[tuple[Interval, ...]]:
    """``world`` contiguous parts of the concatenated intervals, sizes equal ±1."""
    parts, start = [], 0
    for size in even_sizes(span(intervals), world):
        parts.append(take(intervals, start, size))
        start += size
    return parts


def segment_steps(rows: int, world: int, batch_size: int) -> int:
    """Steps every rank runs over a segment of ``rows`` rows: the smallest part decides (every rank runs the
    same number of synchronous steps), each of its batches at most ``batch_size`` rows."""
    return max(1, math.ceil((rows // world) / batch_size))


def consumed(part_rows: int, steps: int, done: int) -> int:
    """Rows of a part of ``part_rows`` rows in its first ``done`` of ``steps`` batches."""
    return sum(even_sizes(part_rows, steps)[:done])


def remaining(segment: Segment, steps: int, done: int) -> tuple[Interval, ...]:
    """What is left of ``segment`` (``steps`` batches per rank) after ``done`` steps: every part minus the
    prefix its rank trained on, in stream order."""
    left: list[Interval] = []
    for part in cut(segment.intervals, segment.world):
        rows = span(part)
        used = consumed(rows, steps, done)
        left += take(part, used, rows - used)
    return tuple(left)


@dataclass(frozen=True)
class Window:
    """Consecutive row groups of the epoch's order whose rows are permuted together; ``start``: its first
    stream position."""

    groups: tuple[int, ...]  # indices into the loader's row-group list
    start: int
    rows: int


def epoch_windows(group_rows: Sequence[int], seed, epoch: int, window_rows: int, shuffle: bool) -> list[Window]:
    """The epoch's stream layout: row groups in their seeded order, cut into windows of >= window_rows rows
    (the last may be smaller). Without shuffle: file order, one group per window."""
    order = list(range(len(group_rows)))
    if shuffle:
        order = [int(i) for i in epoch_rng(seed, epoch).permutation(len(order))]
    windows, current, rows, start = [], [], 0, 0
    limit = max(1, window_rows) if shuffle else 1
    for index in order:
        current.append(index)
        rows += int(group_rows[index])
        if rows >= limit:
            windows.append(Window(tuple(current), start, rows))
            start += rows
            current, rows = [], 0
    if current:
        windows.append(Window(tuple(current), start, rows))
    return windows


def _entropy(seed) -> list[int]:
    """SeedSequence words of a seed: an int, or a list of ints (a legacy per-rank stream: [seed, rank])."""
    return [int(v) % 2**64 for v in (seed if isinstance(seed, (list, tuple)) else [seed])]


def window_order(seed, epoch: int, window: int, rows: int, shuffle: bool):
    """The permutation of a window's rows (identity without shuffle): position p of the window is row
    ``order[p]`` of its groups' rows concatenated."""
    import numpy as np

    if not shuffle:
        return np.arange(rows)
    return np.random.default_rng(np.random.SeedSequence([*_entropy(seed), epoch, window, 1])).permutation(rows)


def epoch_rng(seed, epoch: int):
    import numpy as np

    return np.random.default_rng(np.random.SeedSequence([*_entropy(seed), epoch, 0]))


def pieces(windows: Sequence[Window], intervals: Sequence[Interval]) -> list[tuple[int, int, int]]:
    """(window number, lo, hi) slices of window positions covering ``intervals`` in order."""
    import bisect

    out = []
    starts = [w.start for w in windows]
    for a, b in intervals:
        k = max(bisect.bisect_right(starts, a) - 1, 0)
        while a < b and k < len(windows):
            w = windows[k]
            lo, hi = a - w.start, min(b, w.start + w.rows) - w.start
            if lo < hi:
                out.append((k, lo, hi))
                a = w.start + hi
            k += 1
    return out


def position(segment: Optional[Segment], epoch: int, total_rows: int, world: int) -> Segment:
    """The segment a rank of a ``world``-rank run reads in ``epoch``: the resumed one, or the whole stream."""
    if segment is not None and segment.epoch == epoch:
        return segment
    return Segment(epoch, ((0, total_rows),), world, 0)


@dataclass(frozen=True)
class StreamPlan:
    """How a run's global steps map onto epochs and stream segments: step ``offset + epoch * steps_per_epoch
    + batch``. A fresh run has offset 0 and no resumed segment; a run resumed with another world size has
    the rest of the interrupted epoch as ``resumed`` (``base`` batches of it counted as done) and the offset
    that lines its first step up with that batch. Recorded in every checkpoint (``record``)."""

    total_rows: int
    world: int
    steps_per_epoch: int
    offset: int = 0
    resumed: Optional[Segment] = None
    window_rows: int = 65_536
    shuffle: bool = True

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch's steps_per_epoch) of global step ``step``."""
        return divmod(step - self.offset, self.steps_per_epoch)

    def total_steps(self, epochs: int) -> int:
        """The global step at which ``epochs`` epochs are done (what the server's version ends at)."""
        return self.offset + self.steps_per_epoch * epochs

    def record(self) -> dict:
        return {"total_rows": self.total_rows, "world": self.world, "steps_per_epoch": self.steps_per_epoch,
                "offset": self.offset, "resumed": None if self.resumed is None else self.resumed.record(),
                "window_rows": self.window_rows, "shuffle": self.shuffle}

    @classmethod
    def of(cls, record: dict) -> "StreamPlan":
        resumed = record.get("resumed")
        return cls(int(record["total_rows"]), int(record["world"]), int(record["steps_per_epoch"]),
                   int(record.get("offset", 0)), None if resumed is None else Segment.of(resumed),
                   int(record.get("window_rows", 65_536)), bool(record.get("shuffle", True)))

    def resume(self, step: int, world: int, batch_size: int, window_rows: int, shuffle: bool) -> "StreamPlan":
        """The plan of a run resuming at global ``step`` with ``world`` workers of ``batch_size`` rows.

        Same world and steps: the same plan (the interrupted epoch continues batch for batch). Otherwise the
        rest of the interrupted epoch (every rank's part minus the batches it trained on) is cut into
        ``world`` parts, its steps recomputed; later epochs are whole streams cut ``world`` ways."""
        from pipeline.errors import ConfigError, DataError

        steps = segment_steps(self.total_rows, world, batch_size)
        epoch, batch = self.locate(step)
        fresh = StreamPlan(self.total_rows, world, steps, 0, None, window_rows, shuffle)
        if batch == 0 and (self.resumed is None or self.resumed.epoch != epoch):
            return replace(fresh, offset=step - epoch * steps)  # at an epoch boundary: nothing to carry
        if (window_rows, shuffle) != (self.window_rows, self.shuffle):
            raise ConfigError(f"cannot resume mid-epoch {epoch}: the run read its rows with data.shuffle="
                              f"{self.shuffle} and data.shuffle_buffer_rows={self.window_rows}, the config says "
                              f"{shuffle} and {window_rows}; use the run's values (they fix which rows are left)")
        if world == self.world and steps == self.steps_per_epoch:
            return replace(self, window_rows=window_rows, shuffle=shuffle)
        segment = position(self.resumed, epoch, self.total_rows, self.world)
        left = remaining(segment, self.steps_per_epoch - segment.base, batch - segment.base)
        rows = span(left)
        if rows < world:
            raise DataError(f"cannot resume epoch {epoch} with parallelism.data={world}: only {rows} of its rows are "
                            f"left, fewer than one per worker; resume with parallelism.data <= {rows}")
        base = steps - segment_steps(rows, world, batch_size)
        return replace(fresh, offset=step - (epoch * steps + base), resumed=Segment(epoch, left, world, base))
