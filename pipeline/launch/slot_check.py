"""Driver side, between barrier attempts: are the barrier's task slots still there?

After a host is lost, Spark would run the next barrier stage only when it has every slot, and until then
retries it quietly ("Barrier stage ... requires 3 slots, but only 2 are available. Will retry up to 31
more times", 15 s apart, ~8 minutes), and a host cut off (its link down, no FIN, no RST) stays in Spark's
books until its heartbeats time out (spark.network.timeout, 120 s by default), so the next attempt would
be scheduled onto it and wait out the connect deadline. So before each retry the driver:

1. probes every executor Spark lists with a TCP connect (``executors.PROBE_S``, all at once): one that does
   not answer is removed from the slots, and Spark is told it is lost (``executors.declare_lost``; the stage
   watchdog does the same when it cancels a stage whose tasks do not stop);
2. waits up to ``timeouts.slots_s`` for the slots to be back (a crashed executor's replacement starting);
3. then either retries on them, shrinks the run to the slots there are (``ClusterShrank``, which
   ``launch.train`` turns into an elastic resume from the newest state, with ``train.min_workers``), or
   fails at once, saying how many slots are missing, which host left and the fix.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from pipeline.errors import WorkerTrainingFailedError
from pipeline.executors import ClusterView, cluster_view, declare_lost, declared_lost, is_local_master, unreachable

log = logging.getLogger(__name__)
SLOTS_KEY = "timeouts.slots_s"


class ClusterShrank(Exception):
    """Fewer slots than the run's workers, but at least train.min_workers: continue on ``slots`` workers.
    A signal inside launch (``launch.train`` catches it), never an error a user sees."""

    def __init__(self, slots: int, message: str, failure: WorkerTrainingFailedError):
        self.slots = slots
        self.failure = failure
        super().__init__(message)


class SlotCheck:
    """Made when training starts (its executors' hosts are the ones a later check misses)."""

    def __init__(self, spark, workers: int, min_workers: Optional[int], wait_s: float):
        self._spark = spark
        self._workers = workers
        self._min_workers = min_workers
        self._wait_s = wait_s
        view = None if is_local_master(spark) else cluster_view(spark)
        # local[N]: the driver runs the tasks, there are no executors to count. Spark Connect, or a cluster
        # whose executors cannot be seen: no check (preflight's static one still ran).
        self._enabled = view is not None and bool(view.executors)
        self._hosts_at_start = set(view.slots) if self._enabled else set()

    def before_retry(self, attempt: int, failure: WorkerTrainingFailedError) -> None:
        """Return when the next attempt has its slots; raise ClusterShrank or the run's final error."""
        view = cluster_view(self._spark) if self._enabled else None
        if view is None:
            return
        view = self._drop_unreachable(view)
        deadline = time.monotonic() + self._wait_s
        while view.total_slots < self._workers and time.monotonic() < deadline:
            time.sleep(0.5)
            view = (cluster_view(self._spark) or view).without(declared_lost(self._spark))
        if view.total_slots >= self._workers:
            return
        self._fall_short(view, attempt, failure)

    def _drop_unreachable(self, view: ClusterView) -> ClusterView:
        # Those the stage watchdog already declared lost are left out, not probed again (2 s each time).
        for executor in unreachable(list(view.without(declared_lost(self._spark)).executors)):
            declare_lost(self._spark, executor)
        return view.without(declared_lost(self._spark))

    def _fall_short(self, view: ClusterView, attempt: int, failure: WorkerTrainingFailedError) -> None:
        slots = view.total_slots
        gone_hosts = sorted(self._hosts_at_start - set(view.slots))
        left = (f"host(s) {', '.join(gone_hosts)} left the cluster" if gone_hosts
                else "executors were lost")
        short = (f"the barrier needs {self._workers} task slots, the cluster has {slots} now "
                 f"({self._workers - slots} missing: {left}; waited {self._wait_s:g}s for them, {SLOTS_KEY})")
        if self._min_workers is not None and slots >= self._min_workers:
            raise ClusterShrank(slots, f"{short}; train.min_workers={self._min_workers} lets the run go on with "
                                       f"{slots} workers", failure)
        fix = (f"bring the host(s) back or add executors, or set train.min_workers={max(slots, 1)} to go on with the "
               "hosts that are left" if slots else "bring the hosts back or add executors")
        if self._min_workers is not None:
            fix = f"train.min_workers={self._min_workers} is more than that; {fix}"
        cause = f"{failure.cause + '; ' if failure.cause else ''}cannot retry: {short}; {fix}"
        raise WorkerTrainingFailedError(failure.failures, attempt, cause, failure.stopped)
