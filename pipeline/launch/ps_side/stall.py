"""Beside the PS: silent ranks as a named state, so a stalled run is told from a hung one.

A rank whose host is cut off sends nothing and gets no error: its peers block in the synchronous step
until the step deadline (timeouts.step_s, 120 s by default) fails the attempt, or the link comes back
and training goes on as if nothing happened. Without this watch both look like silence in the log.

A rank is *silent* when the PS has no request of it in flight (it is not waiting in a step, which the
PS would be serving) and has heard nothing from it for ``timeouts.stall_s``. The watch then logs one
WARNING naming the silent ranks, their hosts, the ranks waiting for them and what happens next; an INFO
when each is heard again; the step bar shows it; and each epoch row gets ``rank<r>/stall_s``, the
seconds each rank spent in silences that reached the threshold (all of such a silence, not just its part
past the threshold; shorter ones count 0), within that epoch (MLflow plots them per rank).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from pipeline.wire.deadline import Timeout

log = logging.getLogger(__name__)
STALL_KEY = "timeouts.stall_s"


class StallWatch:
    """Polls ``server.silences`` while a barrier attempt runs (a context manager, entered per attempt);
    its per-rank silent seconds carry over between attempts until an epoch row takes them."""

    def __init__(self, server, world_size: int, *, stall_s: float, step: Timeout, next_step: Callable[[], str],
                 show: Optional[Callable[[Optional[str]], None]] = None, poll_s: Optional[float] = None):
        self._server = server
        self._world_size = world_size
        self._stall_s = float(stall_s)
        self._step = step
        self._next_step = next_step  # what the driver does if the rank stays silent: the retry policy's words
        self._show = show or (lambda note: None)
        self._poll_s = poll_s if poll_s is not None else min(0.5, self._stall_s / 4)
        self._lock = threading.Lock()
        # rank -> (counted from, host, silent since), past the threshold; an epoch row moves "counted from"
        self._open: dict[int, tuple[float, str, float]] = {}
        self._total: dict[int, float] = {}  # closed silences not yet taken by an epoch row
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "StallWatch":
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="shardline-stall-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.poll(closing=True)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
            except Exception:  # a monitoring hiccup must never take training down
                log.debug("stall watch poll failed", exc_info=True)

    def poll(self, closing: bool = False) -> None:
        """One look at the server: open silences past the threshold, close those heard from again."""
        silences = {} if closing else self._server.silences
        now = time.monotonic()
        started, ended = [], []
        with self._lock:
            for rank, (silent, host) in sorted(silences.items()):
                if silent >= self._stall_s and rank not in self._open:
                    self._open[rank] = (now - silent, host, now - silent)
                    started.append((rank, silent, host))
            for rank, (counted, host, since) in sorted(self._open.items()):
                silent, _ = silences.get(rank, (None, host))
                if silent is None or silent < self._stall_s:
                    # heard again (the silence ended `silent` seconds ago), or gone: its drop is a failure
                    # the PS reports itself
                    end = now - (silent or 0.0)
                    self._total[rank] = self._total.get(rank, 0.0) + max(0.0, end - counted)
                    del self._open[rank]
                    ended.append((rank, end - since, host, silent is not None))
            note = self._note_locked(now)
        if started:
            self._warn(started, silences)
        for rank, seconds, host, back in ended:
            if back:
                log.warning("rank %d%s was heard from again after %.1fs of silence; training goes on", rank,
                            f" on host {host}" if host else "", seconds)
        if started or ended:
            self._show(note)

    def _note_locked(self, now: float) -> Optional[str]:
        if not self._open:
            return None
        return "silent: " + ", ".join(f"rank {r} {now - since:.0f}s" for r, (_, _, since) in sorted(self._open.items()))

    def _warn(self, started: list[tuple[int, float, str]], silences: dict[int, tuple[float, str]]) -> None:
        ranks = ", ".join(f"{rank}{f' on host {host}' if host else ''}" for rank, _, host in started)
        longest = max(silent for _, silent, _ in started)
        waiting = sorted(r for r, (silent, _) in silences.items() if silent < self._stall_s)
        left = max(0.0, self._step.seconds - longest)
        log.warning("rank(s) %s silent for %.1fs (%s=%g): the parameter server has heard nothing from them and "
                    "has no request of theirs in flight%s. If they stay silent, the step deadline (%s=%gs) fails "
                    "this attempt in about %.0fs; then %s. If the host comes back before that, training goes on "
                    "where it stopped.", ranks, longest, STALL_KEY, self._stall_s,
                    f"; rank(s) {waiting} wait for them" if waiting else "", self._step.key, self._step.seconds,
                    left, self._next_step())

    def epoch_metrics(self) -> dict[str, float]:
        """``rank<r>/stall_s`` for every rank: seconds silent past the threshold since the last call."""
        now = time.monotonic()
        with self._lock:
            taken = dict(self._total)
            self._total.clear()
            for rank, (counted, host, since) in self._open.items():
                taken[rank] = taken.get(rank, 0.0) + (now - counted)
                self._open[rank] = (now, host, since)
        return {f"rank{rank}/stall_s": round(taken.get(rank, 0.0), 3) for rank in range(self._world_size)}
