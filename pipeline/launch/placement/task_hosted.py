"""Driver side, ``ps.placement: task``: each attempt's PS lives in rank 0's barrier task
(``task.hosted_ps``); a retry restarts it from this run's newest checkpoint; the history and the final
parameters come back as result rows."""
from __future__ import annotations

import json
import logging
import re
import uuid

from pipeline.errors import WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.attempts import RetryStart, new_tag, raise_for_failed_rows, run_barrier_job, spark_error_summary
from pipeline.launch.placement.run import Outcome, TrainingRun
from pipeline.launch.plans import deadlines, failed_attempt_grace, ps_settings, worker_plans
from pipeline.launch.retry import StateAfterFailure, Verdict

log = logging.getLogger(__name__)


class TaskPS:
    """Attempts whose PS runs in rank 0's task; this process only sees their result rows."""

    def __init__(self, run: TrainingRun):
        self.run = run
        self.resume_from = run.resumed_from  # the checkpoint the next attempt's PS starts from
        # Marks this run's checkpoints: a retry resumes only from one of them (or from --resume's).
        self.launch_id = uuid.uuid4().hex
        self.report: dict = {}

    def __enter__(self) -> "TaskPS":
        cfg = self.run.cfg
        if self.run.resumed is not None:
            self.run.progress.restore(self.run.resumed)  # epochs the resumed run logged
        log.info("training %s: %d workers x %d steps/epoch x %d epochs, PS in rank 0's task (ps.placement=task)",
                 cfg.name, cfg.parallelism.data, self.run.steps_per_epoch, cfg.train.epochs)
        return self

    def __exit__(self, *exc) -> None:
        pass  # the PS lived and died in rank 0's task

    def on_epoch(self, row: dict) -> None:
        pass  # no live bar: epochs arrive when the attempt ends

    def request_stop(self, kind: str, reason: str, epoch: int) -> None:
        log.warning("ps.placement=task: epochs reach the driver when the attempt ends, too late to stop (%s)",
                    reason)

    def _hosted_spec(self, attempt: int):
        from pipeline.launch.task.hosted_ps import HostedPSSpec

        run, cfg = self.run, self.run.cfg
        waits = deadlines(cfg)
        warm = run.initial.detach().cpu().float().reshape(-1).contiguous().numpy().tobytes() if run.warm_started else None
        buffers = run.initial_buffers.detach().cpu().reshape(-1).contiguous().numpy().tobytes()
        return HostedPSSpec(
            world_size=cfg.parallelism.data, generation=attempt, settings=ps_settings(cfg, run.steps_per_epoch, run.step_offset), backend=cfg.train.backend, grace=failed_attempt_grace(cfg),
            connect=waits.connect, peers=waits.step, model=run.spec,
            checkpoint_dir=run.store.directory, keep_checkpoints=cfg.train.keep_checkpoints,
            checkpoint_every=cfg.train.checkpoint_every, checkpoint_every_s=cfg.train.checkpoint_every_s,
            resume_path=self.resume_from.path if self.resume_from else None, warm_start=warm, buffers=buffers,
            checkpoint_meta=run.checkpoint_meta.for_launch(self.launch_id))

    def run_attempt(self, attempt: int) -> list[dict]:
        """One barrier job with the PS in rank 0's task: its rows (rank 0's PS report kept), or
        WorkerTrainingFailedError naming the root-cause rank(s) as the task PS saw them."""
        from pipeline.launch.task.body import TaskWiring, make_task_fn
        from pipeline.ps import new_secret
        from pipeline.wire.tls import job_cert

        run, cfg = self.run, self.run.cfg
        secret = new_secret()  # per attempt: a late task of a failed attempt cannot join the next one
        plans = worker_plans(cfg, run.manifest, run.spec, run.steps_per_epoch, attempt, attempt, stream=run.stream)
        task_fn = make_task_fn(plans, TaskWiring(secret, cfg.train.log_tail_lines, hosted=self._hosted_spec(attempt),
                                                 tls=job_cert(cfg.ps.tls)))
        log.info("barrier attempt %d (PS in rank 0's task)", attempt)
        rows = run_barrier_job(run.spark, task_fn, cfg.parallelism.data, tag=new_tag(),
                               on_job_error=lambda exc: self._job_failure(exc, attempt))
        head = next((r for r in rows if r["rank"] == 0), None)
        report = json.loads(head["ps_report"]) if head is not None and head.get("ps_report") else None
        roots = [int(r) for r in (report or {}).get("root_failures", [])]
        raise_for_failed_rows(rows, roots, attempt, first_cause_only=run.allreduce)
        if report is None:
            raise WorkerTrainingFailedError({0: WorkerFailure(0, "rank 0 returned no PS report")}, attempt)
        self.report = report
        return rows

    @staticmethod
    def _job_failure(exc: BaseException, attempt: int) -> WorkerTrainingFailedError:
        from pipeline.launch.task.rows import decode_failure_report, failure_of

        why = spark_error_summary(exc)
        embedded = decode_failure_report(str(exc))
        if embedded and embedded.get("failures"):
            # Rank 0 stopped the stage itself (ranks stuck past the deadline) and sent its PS's account.
            roots = [int(r) for r in embedded.get("root_failures", [])] or [int(r) for r in embedded["failures"]]
            failures = {int(r): failure_of(int(r), entry) for r, entry in embedded["failures"].items()
                        if int(r) in roots[:1]}
            return WorkerTrainingFailedError(failures, attempt, cause=embedded.get("reason", why))
        # No rank could report (the stage is torn down as soon as one task dies); Spark names the task.
        crashed = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", str(exc))
        rank = int(crashed.group(1)) if crashed else -1
        text = (f"the task of rank {rank} died and Spark stopped the barrier stage" if crashed else
                "the barrier stage failed before the ranks reported")
        if rank <= 0:
            text += " (rank 0's task hosts the parameter server: its state since the last checkpoint is lost)"
        return WorkerTrainingFailedError({rank: WorkerFailure(rank, text)}, attempt, cause=why)

    def state_after_failure(self) -> StateAfterFailure:
        """The attempt's PS died with rank 0's task: what is left is this run's checkpoints."""
        return StateAfterFailure.NONE if self.run.allreduce else StateAfterFailure.CHECKPOINT

    def prepare_retry(self, attempt: int, failure: WorkerTrainingFailedError, verdict: Verdict) -> RetryStart:
        from pipeline.checkpoints import own_latest

        if verdict is Verdict.RETRY_FROM_CHECKPOINT:
            self.resume_from = own_latest(self.run.store, self.launch_id, self.resume_from)
        else:  # RETRY_FROM_START
            self.resume_from = None
        if self.resume_from is None:
            return RetryStart(0, "the start")
        return RetryStart(self.resume_from.step, f"checkpoint step {self.resume_from.step}")

    def outcome(self, rows: list[dict]) -> Outcome:
        from pipeline.launch.merge import replica_buffers, replica_outcome, task_ps_buffers, task_ps_parameters

        run, report = self.run, self.report
        run.progress.replay(report["history"])
        if run.allreduce:
            parameters, version, expected = replica_outcome(rows, run.initial.numel(), 1,
                                                            run.steps_per_epoch * run.cfg.train.epochs)
            buffers = replica_buffers(rows, run.initial_buffers.numel())
        else:
            parameters, version = task_ps_parameters(rows, run.initial.numel()), int(report["version"])
            buffers = task_ps_buffers(rows, run.initial_buffers.numel())
            expected = run.expected_version
        stats = dict(report["stats"])  # through JSON: restore the integer rank keys
        if isinstance(stats.get("steps_applied_by_rank"), dict):
            stats["steps_applied_by_rank"] = {int(k): v for k, v in stats["steps_applied_by_rank"].items()}
        self._warn_if_checkpoints_invisible()
        log.info("PS in rank 0's task at %s", report["address"])
        return Outcome(parameters, version, expected, stats, [{k: v for k, v in r.items() if k != "ps_report"}
                                                               for r in rows], buffers)

    def _warn_if_checkpoints_invisible(self) -> None:
        """Rank 0's task writes the checkpoints; a path only its executor can see makes retries start over."""
        store = self.run.store
        written = set(self.report.get("checkpoints") or [])
        if written and not written & {c.step for c in store.list()}:
            log.warning("rank 0's task wrote checkpoints at steps %s to %s, but the driver cannot see them there: "
                        "with ps.placement=task, train.checkpoint_dir must be shared storage (an fsspec URL or a "
                        "mount every node sees), or a retry starts from scratch", sorted(written), store.directory)
