"""The ordered rows between a loader's reader and its batches: (features, labels) blocks of numpy arrays in
stream order, cut into batches of exactly the sizes asked. Both readers use it (``planned.sized_batches``
for the global row stream, ``stream.StreamingLoader`` for petastorm and a rank's own files)."""
from __future__ import annotations

from collections import deque


class RowQueue:
    """Blocks appended in stream order; ``cut(n)`` takes the next n rows as torch tensors: a view of one
    block (no copy), or a small concatenation where a batch straddles blocks."""

    def __init__(self, pin: bool = False) -> None:
        self._blocks: deque = deque()
        self._pin = pin
        self.rows = 0  # rows queued

    def append(self, block: tuple) -> None:
        self._blocks.append(block)
        self.rows += len(block[1])

    def cut(self, size: int, keep: bool = True):
        """The next ``size`` rows; with keep=False they are only dropped (a resumed epoch skipping its
        applied steps) and None is returned."""
        import numpy as np
        import torch

        xs, ys, need = [], [], size
        while need:
            x, y = self._blocks[0]
            if len(y) <= need:
                self._blocks.popleft()
            else:
                self._blocks[0] = ({key: value[need:] for key, value in x.items()}, y[need:])
                x, y = {key: value[:need] for key, value in x.items()}, y[:need]
            xs.append(x)
            ys.append(y)
            need -= len(y)
        self.rows -= size
        if not keep:
            return None
        if len(xs) == 1:
            x, y = xs[0], ys[0]
        else:
            x, y = {key: np.concatenate([part[key] for part in xs]) for key in xs[0]}, np.concatenate(ys)
        x, y = {key: torch.from_numpy(value) for key, value in x.items()}, torch.from_numpy(y)
        if self._pin:
            return {key: value.pin_memory() for key, value in x.items()}, y.pin_memory()
        return x, y
