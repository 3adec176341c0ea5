"""A fixed-capacity shuffle buffer: rows go in a row group at a time and come out as random batches.

Memory is allocated once (capacity + the largest row group) and reused, so a rank's loader memory is
bounded by the buffer size, not by its shard size. Taking a batch is O(batch): random slots are
gathered, then refilled from the buffer's tail (swap-remove), so nothing is shifted.
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

    def __len__(self) -> int:
        return self._rows - self._start

    @property
    def slots(self) -> int:
        return len(self._labels)

    def add(self, features, labels) -> None:
        n = len(labels)
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
        """n rows (copies): random without replacement when the buffer has an rng, else the oldest."""
        import numpy as np

        if n > len(self):
            raise ValueError(f"internal: asked for {n} rows, the shuffle buffer holds {len(self)}; please report this")
        if self.rng is None:
            begin = self._start
            self._start += n
            return self._features[begin:begin + n].copy(), self._labels[begin:begin + n].copy()
        rows = self._rows
        picked = self.rng.choice(rows, size=n, replace=False)
        features, labels = self._features[picked], self._labels[picked]
        keep = rows - n
        holes = picked[picked < keep]
        tail_free = np.ones(n, dtype=bool)
        tail_free[picked[picked >= keep] - keep] = False
        sources = keep + np.flatnonzero(tail_free)
        self._features[holes] = self._features[sources]
        self._labels[holes] = self._labels[sources]
        self._rows = keep
        return features, labels
