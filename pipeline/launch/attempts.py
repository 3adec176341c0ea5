"""Driver side: the one attempt loop every placement runs through, and the barrier job of one attempt.

A placement (``placement.DriverPS`` / ``placement.TaskPS``) says how an attempt is wired and how a retry
starts; this module owns what is the same for all: the Spark job (tag, interrupt, teardown), turning
failed result rows into one ``WorkerTrainingFailedError`` (root causes vs ranks that only stopped), and
asking the ``RetryPolicy`` what to do next.
"""
from __future__ import annotations

import logging
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from pipeline.errors import WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.retry import FailureAccount, RetryPolicy, StateAfterFailure, Verdict, given_up
from pipeline.launch.task.rows import RESULT_SCHEMA, merge_chunks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryStart:
    """Where the next attempt starts: the step, and how to say it in the log."""

    step: int
    description: str


class Placement(Protocol):
    """Where the PS lives during the attempts (``placement.driver_hosted.DriverPS``, ``placement.task_hosted.TaskPS``);
    a context manager around all attempts of one run."""

    def run_attempt(self, attempt: int) -> list[dict]:
        """One barrier job: its result rows, or WorkerTrainingFailedError naming the root-cause rank(s)."""

    def state_after_failure(self) -> StateAfterFailure:
        """What training state the failed attempt left."""

    def prepare_retry(self, attempt: int, failure: WorkerTrainingFailedError, verdict: Verdict) -> RetryStart:
        """Make the next attempt start as ``verdict`` says; raise WorkerTrainingFailedError when it cannot."""


def run_attempts(placement: Placement, policy: RetryPolicy, slots=None) -> tuple[list[dict], list[dict]]:
    """Attempts until one succeeds: (its rows, one entry per failed attempt that was retried). ``slots``
    (a ``slot_check.SlotCheck``) checks before each retry that the barrier's task slots are there."""
    failed_attempts: list[dict] = []
    attempt = 1
    while True:
        try:
            return placement.run_attempt(attempt), failed_attempts
        except WorkerTrainingFailedError as failure:
            failure.attempt = attempt
            decision = policy.decide(FailureAccount(attempt, failure, placement.state_after_failure()))
            if decision.verdict is Verdict.GIVE_UP:
                raise given_up(failure, attempt, decision.reason) from failure
            start = placement.prepare_retry(attempt, failure, decision.verdict)
            failed_attempts.append({"attempt": attempt, "ranks": sorted(failure.failures), "step": start.step,
                                    "error": str(failure)[:4000]})
            if slots is not None:
                try:
                    slots.before_retry(attempt, failure)  # may shrink the run (ClusterShrank) or end it
                except Exception as stop:  # ClusterShrank, or the run's end: either way they happened
                    stop.failed_attempts = failed_attempts  # the shrunk run carries them on
                    raise
            log.warning("attempt %d of %d failed; retrying from %s\n%s", attempt, policy.max_attempts,
                        start.description, failure)
            attempt += 1


def spark_error_summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(text[:3])[:1000] if text else type(exc).__name__


def new_tag() -> str:
    """A job tag for one attempt's barrier stage (what interrupting the attempt cancels)."""
    return f"shardline-train-{uuid.uuid4().hex[:12]}"


def run_barrier_job(spark, task_fn, tasks: int, *, tag: str, guards: Sequence = (),
                    on_job_error: Callable[[BaseException], Optional[WorkerTrainingFailedError]]) -> list[dict]:
    """One barrier stage of ``tasks`` tasks through mapInArrow (classic and Connect sessions alike); the
    merged result rows. ``guards`` (context managers: a watchdog, a progress bar) run while the job does.
    When the job fails, ``on_job_error`` (called before the job is interrupted, which happens whatever it
    does) turns the error into the attempt's failure account; KeyboardInterrupt & co are re-raised."""
    spark.addTag(tag)
    try:
        with ExitStack() as running:
            for guard in guards:
                running.enter_context(guard)
            frame = spark.range(0, tasks, 1, tasks)
            return merge_chunks([r.asDict() for r in frame.mapInArrow(task_fn, RESULT_SCHEMA, barrier=True).collect()])
    except BaseException as exc:
        try:
            failure = on_job_error(exc)
        finally:
            interrupt(spark, tag)
        if failure is None or not isinstance(exc, Exception):
            raise
        raise failure from exc
    finally:
        spark.removeTag(tag)


def raise_for_failed_rows(rows: list[dict], root_causes: list[int], attempt: int, *, first_cause_only: bool) -> None:
    """One WorkerTrainingFailedError for an attempt whose rows report failures: the root-cause ranks (in the
    order the PS heard of them) as failures, the rest as ranks that stopped because of them."""
    failed = [r for r in rows if not r["ok"]]
    if not failed:
        return
    if first_cause_only:
        # allreduce: a rank that dies takes its peers' collectives down with it ("Connection closed by
        # peer"); those are consequences, and the PS heard of the cause first.
        root_causes = root_causes[:1]
    primary = [r for r in failed if r["rank"] in root_causes] or failed
    raise WorkerTrainingFailedError(
        {r["rank"]: WorkerFailure(r["rank"], r["error"], r["log_tail"] or "", r.get("retryable") is not False)
         for r in primary}, attempt, stopped={r["rank"]: r["error"] for r in failed if r not in primary})


def interrupt(spark, tag: str) -> None:
    try:
        spark.interruptTag(tag)
    except Exception:  # teardown is best effort; the original error is what matters
        log.debug("could not interrupt jobs tagged %s", tag, exc_info=True)
