"""A fixed-capacity shuffle buffer: rows go in a row group at a time and come out as random batches.

Memory is allocated once (capacity + the largest row group) and reused, so a rank's loader memory is
bounded by the buffer size, not by its shard size. With an rng the rows never move once written: the
buffer keeps a compact list of its occupied slots (`_order`, ints) and a stack of free ones. Taking n
rows picks n random positions of that list, gathers their rows with one np.take (a row-wise memcpy of
the contiguous float32 block), swap-removes the positions from the int list and frees the slots; adding
writes the new rows straight into free slots. So per row: one copy in, one copy out, no compaction.
The loader takes every row beyond its capacity in one call per row group, then slices batches.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class ShuffleBuffer:
    def __init__(self, slots: int, width: int, label_dtype, rng=None):
        import numpy as np

        self._features = np.empty((slots, width), dtype=np.float32)
        self._labels = np.empty(slots, dtype=label_dtype)
        self._rows = 0
        self._start = 0  # FIFO mode (no rng): rows before this were already taken
        self.rng = rng
        self.peak_rows = 0
        if rng is not None:
            self._order = np.empty(slots, dtype=np.intp)  # [:_rows]: occupied slots, in draw order
            self._free = np.arange(slots - 1, -1, -1, dtype=np.intp)  # [:_nfree]: a stack, low slots on top
            self._nfree = slots

    def __len__(self) -> int:
        return self._rows - self._start

    @property
    def slots(self) -> int:
        return len(self._labels)

    def add(self, features, labels) -> None:
        import numpy as np

        n = len(labels)
        if self.rng is not None:
            if n > self._nfree:
                raise ValueError(f"internal: shuffle buffer of {self.slots} slots cannot take {n} more rows "
                                 f"(holding {self._rows}); please report this")
            slots = self._free[self._nfree - n:self._nfree][::-1]
            self._nfree -= n
            lo = int(slots.min()) if n else 0
            if n and int(slots.max()) == lo + n - 1:  # free slots are distinct: they are exactly lo..lo+n-1
                self._features[lo:lo + n] = features  # e.g. a fresh buffer: plain copies, no scatter
                self._labels[lo:lo + n] = labels
                self._order[self._rows:self._rows + n] = np.arange(lo, lo + n)
            else:
                self._features[slots] = features
                self._labels[slots] = labels
                self._order[self._rows:self._rows + n] = slots
            self._rows += n
            self.peak_rows = max(self.peak_rows, self._rows)
            return
        if self._start:  # FIFO: move the untaken rows to the front first
            live = len(self)
            self._features[:live] = self._features[self._start:self._rows]
            self._labels[:live] = self._labels[self._start:self._rows]
            self._rows, self._start = live, 0
        if self._rows + n > self.slots:
            raise ValueError(f"internal: shuffle buffer of {self.slots} slots cannot take {n} more rows "
                             f"(holding {self._rows}); please report this")
        self._features[self._rows:self._rows + n] = features
        self._labels[self._rows:self._rows + n] = labels
        self._rows += n
        self.peak_rows = max(self.peak_rows, self._rows)

    def take(self, n: int):
        """n rows (new arrays): random without replacement when the buffer has an rng, else the oldest."""
        import numpy as np

        if n > len(self):
            raise ValueError(f"internal: asked for {n} rows, the shuffle buffer holds {len(self)}; please report this")
        if self.rng is None:
            begin = self._start
            self._start += n
            return self._features[begin:begin + n].copy(), self._labels[begin:begin + n].copy()
        rows = self._rows
        picked = self.rng.choice(rows, size=n, replace=False)  # positions in the occupied list
        slots = self._order[picked]
        features, labels = np.take(self._features, slots, axis=0), np.take(self._labels, slots)
        # swap-remove the picked positions (ints only): holes below `keep` get the unpicked tail entries
        keep = rows - n
        holes = picked[picked < keep]
        tail_free = np.ones(n, dtype=bool)
        tail_free[picked[picked >= keep] - keep] = False
        self._order[holes] = self._order[keep + np.flatnonzero(tail_free)]
        self._rows = keep
        self._free[self._nfree:self._nfree + n] = slots
        self._nfree += n
        return features, labels
