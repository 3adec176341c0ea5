"""What Spark knows of its executors now: which hosts they run on, their task slots, which of them
still answer. Classic sessions only (it reads the JVM's status store); under Spark Connect, where a
client cannot see executors, every function answers None or nothing, and callers skip their check.

Kept out of ``pipeline.launch``, which never touches the SparkContext (one launch path for classic and
Connect sessions): launch asks this module, and works on without an answer.

Where the numbers come from: Spark's status store (``SparkContext.statusStore().executorList``), the one
that feeds the UI's executors page; it is kept with the UI off too.
"""
from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)
# Cluster managers start executors after the application: how long wait_for_executors waits for the
# first to register before it answers with what is there (Spark's own scheduler waits up to 30 s too:
# spark.scheduler.maxRegisteredResourcesWaitingTime).
FIRST_EXECUTOR_WAIT_S = 30.0
PROBE_S = 2.0  # a live executor on a reachable host accepts within milliseconds
_SINGLE_HOST_MASTERS = ("local", "local-cluster")


@dataclass(frozen=True)
class Executor:
    id: str
    host: str
    port: int
    slots: int


@dataclass(frozen=True)
class ClusterView:
    """The driver's address and the live executors."""

    driver: str
    executors: tuple[Executor, ...]

    @property
    def slots(self) -> dict[str, int]:
        """Task slots per host address."""
        out: dict[str, int] = {}
        for e in self.executors:
            out[e.host] = out.get(e.host, 0) + e.slots
        return out

    @property
    def remote_hosts(self) -> list[str]:
        """Executor hosts other than the driver's."""
        return sorted(h for h in self.slots if h != self.driver)

    @property
    def total_slots(self) -> int:
        return sum(e.slots for e in self.executors)

    def without(self, ids: set[str]) -> "ClusterView":
        return ClusterView(self.driver, tuple(e for e in self.executors if e.id not in ids))


def _context(spark):
    try:
        return spark.sparkContext  # a Connect session raises here
    except Exception:
        return None


def cluster_view(spark) -> Optional[ClusterView]:
    """What Spark knows of its executors now, or None where the session cannot tell (Spark Connect)."""
    sc = _context(spark)
    if sc is None:
        return None
    try:
        task_cpus = int(sc.getConf().get("spark.task.cpus", "1") or 1)
        summaries = sc._jsc.sc().statusStore().executorList(True)  # active executors only
        driver = sc.getConf().get("spark.driver.host", "") or ""
        executors = []
        for i in range(summaries.size()):
            summary = summaries.apply(i)
            host, port = summary.hostPort().rsplit(":", 1)
            if summary.id() == "driver":
                driver = driver or host
                continue
            executors.append(Executor(summary.id(), host, int(port), int(summary.totalCores()) // task_cpus))
        return ClusterView(driver, tuple(executors))
    except Exception:  # a JVM API that moved: no view rather than a failed run
        log.debug("cannot read the executors from Spark's status store", exc_info=True)
        return None


def unreachable(executors: list[Executor]) -> list[Executor]:
    """The executors that do not accept a TCP connection within PROBE_S (probed all at once)."""
    if not executors:
        return []
    with ThreadPoolExecutor(max_workers=min(len(executors), 32)) as pool:
        answers = list(pool.map(_answers, executors))
    return [e for e, alive in zip(executors, answers) if not alive]


def _answers(executor: Executor) -> bool:
    try:
        with socket.create_connection((executor.host, executor.port), timeout=PROBE_S):
            return True
    except OSError:
        return False


_DECLARED: set[tuple[str, str]] = set()  # (application id, executor id) already declared lost here


def declared_lost(spark) -> set[str]:
    """Ids of this application's executors declared lost here (Spark lists them a moment longer)."""
    app = spark.sparkContext.applicationId
    return {eid for known_app, eid in _DECLARED if known_app == app}


def declare_lost(spark, executor: Executor) -> None:
    """Tell Spark an unreachable executor is gone, as its own heartbeat expiry would (HeartbeatReceiver:
    killAndReplaceExecutor, then TaskScheduler.executorLost), instead of after spark.network.timeout: its
    tasks fail now, so a barrier job waiting on them ends, and no later stage is scheduled onto it."""
    key = (spark.sparkContext.applicationId, executor.id)
    if key in _DECLARED:  # Spark lists it a moment longer; once is enough to say so
        return
    _DECLARED.add(key)
    log.warning("host %s does not answer: executor %s (%s:%d) did not accept a connection within %gs; Spark is "
                "told it is lost, and its %d slot(s) no longer count", executor.host, executor.id, executor.host,
                executor.port, PROBE_S, executor.slots)
    try:
        sc = spark.sparkContext._jsc.sc()
        jvm = spark.sparkContext._jvm
        sc.killExecutor(executor.id)
        reason = jvm.org.apache.spark.scheduler.ExecutorProcessLost(
            f"host {executor.host} unreachable (shardline's probe)", jvm.scala.Option.apply(None), False)
        sc.taskScheduler().executorLost(executor.id, reason)
    except Exception:  # best effort: the slot count leaves it out either way
        log.warning("could not tell Spark that executor %s is lost", executor.id, exc_info=True)


def give_up_unreachable(spark) -> list[Executor]:
    """Probe the executors Spark lists; declare the ones that do not answer lost. Returns those."""
    view = cluster_view(spark)
    gone = unreachable(list(view.without(declared_lost(spark)).executors)) if view is not None else []
    for executor in gone:
        declare_lost(spark, executor)
    return gone


def is_local_master(spark) -> bool:
    sc = _context(spark)
    master = sc.master if sc is not None else ""
    return master.split("[", 1)[0] in _SINGLE_HOST_MASTERS


def wait_for_executors(spark, wait_s: float = FIRST_EXECUTOR_WAIT_S) -> Optional[ClusterView]:
    """The cluster view once an executor has registered (or after ``wait_s``); local masters at once."""
    view = cluster_view(spark)
    if view is None or is_local_master(spark):
        return view
    deadline = time.monotonic() + wait_s
    while not view.slots and time.monotonic() < deadline:
        time.sleep(0.25)
        view = cluster_view(spark) or view
    return view
