"""A fixed-capacity shuffle buffer: rows go in a row group at a time and come out as random batches.

Memory is allocated once (capacity + the largest row group) and reused, so a rank's loader memory is
bounded by the buffer size, not by its shard size. With an rng the rows never move once written: the
buffer keeps a compact list of its occupied slots (`_order`, ints) and a stack of free ones. Taking n
rows picks n random positions of that list, gathers their rows with one np.take (a row-wise memcpy of
the contiguous float32 block), swap-removes the positions from the int list and frees the slots; adding
writes the new rows straight into free slots. So per row: one copy in, one copy out, no compaction.
The loader takes every row beyond its capacity in one call per row group, then slices batches.

A row is several arrays (the batch dict: the numeric block, ids, pixels, tokens...), each held in its own
[slots, *shape] block of its own dtype; `layout` names them. Rows go in and out as (dict, labels).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class ShuffleBuffer:
    def __init__(self, slots: int, layout, label_dtype, rng=None):
        """layout: {key: (row shape, dtype)} of the arrays of a row (an int: one float32 `numeric` block of
        that width)."""
        import numpy as np

        if isinstance(layout, int):
            layout = {"numeric": ((layout,), np.float32)}
        self._features = {key: np.empty((slots, *shape), dtype=dtype) for key, (shape, dtype) in layout.items()}
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
                for key, block in self._features.items():  # e.g. a fresh buffer: plain copies, no scatter
                    block[lo:lo + n] = features[key]
                self._labels[lo:lo + n] = labels
                self._order[self._rows:self._rows + n] = np.arange(lo, lo + n)
            else:
                for key, block in self._features.items():
                    block[slots] = features[key]
                self._labels[slots] = labels
                self._order[self._rows:self._rows + n] = slots
            self._rows += n
            self.peak_rows = max(self.peak_rows, self._rows)
            return
        if self._start:  # FIFO: move the untaken rows to the front first
            live = len(self)
            for block in self._features.values():
                block[:live] = block[self._start:self._rows]
            self._labels[:live] = self._labels[self._start:self._rows]
            self._rows, self._start = live, 0
        if self._rows + n > self.slots:
            raise ValueError(f"internal: shuffle buffer of {self.slots} slots cannot take {n} more rows "
                             f"(holding {self._rows}); please report this")
        for key, block in self._features.items():
            block[self._rows:self._rows + n] = features[key]
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
            return ({key: block[begin:begin + n].copy() for key, block in self._features.items()},
                    self._labels[begin:begin + n].copy())
        rows = self._rows
        picked = self.rng.choice(rows, size=n, replace=False)  # positions in the occupied list
        slots = self._order[picked]
        features = {key: np.take(block, slots, axis=0) for key, block in self._features.items()}
        labels = np.take(self._labels, slots)
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
