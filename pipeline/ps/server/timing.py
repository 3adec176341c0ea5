"""Where a shard's time goes per applied update: adding pushed gradients into the sum (reduce), the
optimizer step (or the average's delta), and, in sync/average, the wait for the slowest rank (first push
of a step to its last). Part of issue 17's per-step breakdown (the worker side: pipeline.worker.timing).

Always on: a few clock reads per push, taken under the shard's lock the counters share, against a push
that costs a full pass over the gradient; so the ``stats`` the driver logs always carry them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class ServerTiming:
    reduce_s: float = 0.0  # grad.add_to / start_sum into the shard's sum, all modes
    optimizer_s: float = 0.0  # the update applied under update_locked (optimizer step, or the mean delta)
    sync_wait_s: float = 0.0  # sync/average: the first push of a step to the last (the slowest rank)
    pushes: int = 0
    updates: int = 0
    first_push_at: float = 0.0  # sync/average: when the current step's first push arrived

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def reduced_locked(self, started: float) -> float:
        """A push's gradient went into the sum; returns the clock reading it ended at."""
        now = time.perf_counter()
        self.reduce_s += now - started
        self.pushes += 1
        return now

    def applied_locked(self, started: float) -> None:
        self.optimizer_s += time.perf_counter() - started
        self.updates += 1

    def report(self) -> dict[str, float]:
        """Totals in seconds and means in ms (per push for the reduce, per update otherwise)."""
        return {"time_reduce_s": self.reduce_s, "time_optimizer_s": self.optimizer_s,
                "time_sync_wait_s": self.sync_wait_s, "timed_updates": self.updates,
                "time_reduce_ms_per_push": 1000.0 * self.reduce_s / max(self.pushes, 1),
                "time_optimizer_ms_per_update": 1000.0 * self.optimizer_s / max(self.updates, 1),
                "time_sync_wait_ms_per_update": 1000.0 * self.sync_wait_s / max(self.updates, 1)}


class EpochTiming:
    """The server's timing between two epoch rows (train.profile, PS on the driver): ``row(stats)`` gives
    ms per applied update of reduce (all of the update's pushes), optimizer and the slowest-rank wait."""

    _KEYS = ("time_reduce_s", "time_optimizer_s", "time_sync_wait_s", "timed_updates")

    def __init__(self) -> None:
        self._last = dict.fromkeys(self._KEYS, 0.0)

    def row(self, stats: dict) -> dict[str, float]:
        now = {key: float(stats.get(key, 0.0)) for key in self._KEYS}
        delta = {key: now[key] - self._last[key] for key in self._KEYS}
        self._last = now
        updates = max(delta["timed_updates"], 1.0)
        return {"ps/reduce_ms": 1000.0 * delta["time_reduce_s"] / updates,
                "ps/optimizer_ms": 1000.0 * delta["time_optimizer_s"] / updates,
                "ps/sync_wait_ms": 1000.0 * delta["time_sync_wait_s"] / updates,
                "ps/updates": delta["timed_updates"]}
