"""Beside the PS (the driver, or rank 0's task with ps.placement=task): a watchdog over a running barrier stage.

Spark's `collect()` has no deadline of its own. The PS fails any step a connected worker stalls, but a
task that never reaches the PS (stuck before connecting) or lingers after the attempt is already lost
would keep the barrier job, and the driver, waiting. The watchdog cancels the job in those cases.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Union

from pipeline.wire.deadline import CONNECT_KEY, STEP_KEY, Timeout

log = logging.getLogger(__name__)
# Until some rank has connected, the stage may still be waiting for slots or forking Python workers.
FIRST_CONNECT_FLOOR_S = 60.0


class StageWatchdog:
    """Cancels the stage when ranks miss the connect deadline, or when a failed attempt outlives `grace_s`."""

    def __init__(self, server, world_size: int, *, connect_timeout_s: Union[float, Timeout],
                 grace_s: Union[float, Timeout], cancel: Callable[[str], None], poll_s: float = 0.2,
                 first_connect_s: Optional[float] = None):
        self._server = server
        self._world_size = world_size
        self._connect = Timeout.of(connect_timeout_s, CONNECT_KEY)
        connect_timeout_s = self._connect.seconds
        self._connect_timeout_s = connect_timeout_s
        # The barrier stage starts every task at once, so the connect deadline counts from the first rank
        # that connects: the time Spark takes to schedule the stage and fork fresh Python workers (which
        # import torch) is not the ranks' fault. Until one connects, a longer floor applies.
        self._first_connect_s = (max(connect_timeout_s, FIRST_CONNECT_FLOOR_S) if first_connect_s is None
                                 else first_connect_s)
        self._grace = Timeout.of(grace_s, STEP_KEY)
        self._grace_s = self._grace.seconds
        self._cancel = cancel
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardline-stage-watchdog", daemon=True)
        self.reason: Optional[str] = None

    def __enter__(self) -> "StageWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _fire(self, reason: str) -> None:
        self.reason = reason
        log.error("cancelling the barrier stage: %s", reason)
        self._server.fail(reason)
        try:
            self._cancel(reason)
        except Exception:  # cancellation is best effort; the PS abort already releases the workers
            log.warning("could not cancel the barrier stage", exc_info=True)

    def _watch(self) -> None:
        started = time.monotonic()
        first_connected: Optional[float] = None
        failed_since: Optional[float] = None
        while not self._stop.wait(self._poll_s):
            now = time.monotonic()
            if self._server.aborted:
                failed_since = failed_since or now
                if now - failed_since > self._grace_s:
                    self._fire(f"the training attempt failed and its tasks did not stop within {self._grace_s:.0f}s "
                               f"({self._grace.key})")
                    return
                continue
            registered = self._server.registered_ranks
            missing = sorted(set(range(self._world_size)) - registered)
            if not missing:
                continue
            if registered and first_connected is None:
                first_connected = now
            if first_connected is None and now - started > self._first_connect_s:
                self._fire(f"no rank connected to the parameter server within {self._first_connect_s:g}s of the "
                           "barrier stage's start (tasks not scheduled, or stuck before connecting)")
                return
            if first_connected is not None and now - first_connected > self._connect_timeout_s:
                self._fire(f"rank(s) {missing} did not connect to the parameter server within "
                           f"{self._connect_timeout_s:g}s of rank(s) {sorted(registered)}; {self._connect.hint} "
                           "if executors start slowly")
                return
