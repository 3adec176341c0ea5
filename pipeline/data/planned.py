"""A rank's part of an epoch's row stream (pipeline.data.assignment) read as chunks, then cut into batches.

Row groups are read in stream order by a small thread pool (pyarrow releases the GIL while decoding),
at most ``threads + 1`` ahead; the rows a rank needs from a window are gathered straight from the window's
row groups in the window's permutation (one copy per row, no staging buffer), so memory is one window
plus the read-ahead, whatever the shard size. Positions the rank does not need are never gathered, and a
resumed epoch starts at its first unread position without reading what came before.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Iterator, Sequence

from pipeline.data.assignment import Window, window_order

log = logging.getLogger(__name__)


def _group_results(reads: Sequence[int], read: Callable[[int], tuple], threads: int, ahead: bool,
                   stop: threading.Event, name: str) -> Iterator[tuple]:
    """read(g) for every g of ``reads``, in order; with ``ahead``, up to threads + 1 in flight."""
    if not ahead and threads == 1:
        for group in reads:
            yield read(group)
        return
    from concurrent.futures import ThreadPoolExecutor

    window: deque = deque()
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    try:
        pending = iter(reads)
        for group in pending:
            window.append(pool.submit(read, group))
            if len(window) > threads:
                break
        while window and not stop.is_set():
            result = window.popleft().result()
            nxt = next(pending, None)
            if nxt is not None:
                window.append(pool.submit(read, nxt))
            yield result
    finally:
        for future in window:
            future.cancel()
        pool.shutdown(wait=True)


def _gather(parts: list[tuple], index):
    """Rows ``index`` (positions in the concatenation of ``parts``' rows) as one (features, labels) pair."""
    import numpy as np

    if len(parts) == 1:
        x, y = parts[0]
        return {key: np.take(value, index, axis=0) for key, value in x.items()}, np.take(y, index)
    sizes = np.array([len(y) for _, y in parts])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    owner = np.searchsorted(offsets, index, side="right") - 1
    by_owner = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=len(parts))
    first_x, first_y = parts[0]
    x_out = {key: np.empty((len(index), *value.shape[1:]), dtype=value.dtype) for key, value in first_x.items()}
    y_out = np.empty(len(index), dtype=first_y.dtype)
    begin = 0
    for j, (x, y) in enumerate(parts):
        if not counts[j]:
            continue
        slots = by_owner[begin:begin + counts[j]]
        rows = index[slots] - offsets[j]
        for key, value in x.items():
            x_out[key][slots] = np.take(value, rows, axis=0)
        y_out[slots] = np.take(y, rows)
        begin += counts[j]
    return x_out, y_out


def planned_chunks(windows: Sequence[Window], pieces: Sequence[tuple[int, int, int]], read: Callable[[int], tuple],
                   *, seed: int, epoch: int, shuffle: bool, threads: int, ahead: bool, stop: threading.Event,
                   name: str) -> Iterator[tuple]:
    """(features dict, labels) for each (window, lo, hi) piece, in order: window positions lo..hi."""
    needed: list[int] = []
    for k, _, _ in pieces:
        if not needed or needed[-1] != k:
            needed.append(k)
    results = _group_results([g for k in needed for g in windows[k].groups], read, threads, ahead, stop, name)
    current, parts, order = None, [], None
    for k, lo, hi in pieces:
        if stop.is_set():
            return
        if k != current:
            parts = [next(results) for _ in windows[k].groups]
            current, order = k, window_order(seed, epoch, k, windows[k].rows, shuffle)
        if not shuffle and len(parts) == 1:  # file order: one copy out of the (read-only) Arrow buffers
            x, y = parts[0]
            yield {key: value[lo:hi].copy() for key, value in x.items()}, y[lo:hi].copy()
        else:
            yield _gather(parts, order[lo:hi])
    results.close()


def sized_batches(chunks: Iterator[tuple], sizes: Sequence[int], pin: bool) -> Iterator[tuple]:
    """Consecutive slices of the chunk stream, of exactly ``sizes`` rows each, as torch tensors (no copy
    unless a batch straddles chunks)."""
    from pipeline.data.row_queue import RowQueue
    from pipeline.errors import DataError

    queue = RowQueue(pin)
    step = 0
    for chunk in chunks:
        queue.append(chunk)
        while step < len(sizes) and queue.rows >= sizes[step]:
            yield queue.cut(sizes[step])
            step += 1
    if step < len(sizes):
        raise DataError(f"the shard files ended {sum(sizes[step:]) - queue.rows} rows short of this rank's part; "
                        "re-run `shardline etl`")
