"""Driver side, ``ps.placement: driver``: the PS, its checkpointer, the stage watchdog and the progress bar
run in this process (the driver, or a Spark Connect client)."""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack

from pipeline.errors import PSError, WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.attempts import (RetryStart, interrupt, new_tag, raise_for_failed_rows, run_barrier_job,
                                      spark_error_summary)
from pipeline.launch.placement.ps_address import local_master, ps_host
from pipeline.launch.placement.run import Outcome, TrainingRun
from pipeline.launch.plans import deadlines, failed_attempt_grace, ps_settings, worker_plans
from pipeline.launch.retry import StateAfterFailure, Verdict

log = logging.getLogger(__name__)
# When Spark reports the stage failed, how long the PS may take to record which rank dropped.
RANK_FAILURE_WAIT_S = 2.0
# After a failed attempt nothing pushes: a consistent state is there at once, or not at all.
STATE_CHECK_S = 0.5


def stage_ranges(run: TrainingRun) -> list[tuple[int, int]]:
    """Each pipeline stage's [start, end) slice of the flat parameter vector."""
    from pipeline.models import build_model
    from pipeline.parallel.stages import stage_slices
    from pipeline.worker.stage_loop import model_stages

    p = run.cfg.parallelism
    return stage_slices(model_stages(build_model(run.spec), p.pipeline, p.cuts))


def _cannot_retry(failure: WorkerTrainingFailedError, attempt: int, why: str) -> WorkerTrainingFailedError:
    cause = f"{failure.cause + '; ' if failure.cause else ''}cannot retry: {why}"
    return WorkerTrainingFailedError(failure.failures, attempt, cause, failure.stopped)


def _cancel(spark, tag: str) -> None:
    """End the attempt's barrier job. A task on a host that was cut off never hears the kill, and Spark
    ends a barrier job only when its tasks end, so the job would wait until Spark's heartbeat timeout
    (spark.network.timeout, 120 s): executors that do not answer a probe are declared lost now."""
    from pipeline.executors import give_up_unreachable

    interrupt(spark, tag)
    give_up_unreachable(spark)


class DriverPS:
    """The PS in this process; it outlives failed attempts, so a retry continues from its state."""

    def __init__(self, run: TrainingRun):
        self.run = run
        self.server = None
        self.sparse = None  # ps.sparse: the server's SparseStore (pipeline.launch.sparse_tables)
        self._stack = ExitStack()
        self._secret = None
        self._tls = None
        self._checkpointer = None
        self._bar = None
        self.monitor = None  # train.early_stopping / train.divergence (launch/monitor.py)
        self._server_timing = None  # train.profile: pipeline.ps.server.timing.EpochTiming
        self._stall = None  # timeouts.stall_s: silent ranks named (launch/ps_side/stall.py); ps backend only
        self._attempt = 1

    def __enter__(self) -> "DriverPS":
        from pipeline.checkpoints import Checkpointer
        from pipeline.launch.ps_side.progress import StepProgress
        from pipeline.ps import new_secret
        from pipeline.wire.tls import job_cert

        run, cfg = self.run, self.run.cfg
        host = ps_host(run.spark, cfg)
        log.info("training %s: %d workers x %d steps/epoch x %d epochs, %d parameters, PS on %s", cfg.name,
                 cfg.parallelism.tasks, run.steps_per_epoch, cfg.train.epochs, run.initial.numel(), host)
        self._secret = new_secret()
        self._tls = job_cert(cfg.ps.tls)  # ps.tls: the per-job certificate, shipped with the secret
        self._host = host
        settings = ps_settings(cfg, run.steps_per_epoch, run.step_offset, local_workers=local_master(run.spark))
        try:
            self.server = self._stack.enter_context(self._build_server(settings))
            if run.resumed is not None:
                self.server.load_state_dict(run.resumed["ps"])
                run.progress.restore(run.resumed)
                log.info("resuming from checkpoint %s at step %d of %d", run.resumed_from.path, self.server.version,
                         run.expected_version)
            # allreduce keeps no state on the server: nothing to checkpoint, and a retry starts over.
            self._checkpointer = self._stack.enter_context(Checkpointer(
                run.store, self._snapshot, lambda: self.server.version, cfg.train.checkpoint_every,
                every_s=cfg.train.checkpoint_every_s, enabled=not run.allreduce))
            self._bar = StepProgress(lambda: self.server.version, run.expected_version)
            if not run.allreduce:  # allreduce ranks talk to the PS only per epoch: silence is their normal
                from pipeline.launch.ps_side.stall import StallWatch

                self._stall = StallWatch(self.server, cfg.parallelism.tasks, stall_s=cfg.timeouts.stall_s,
                                         step=deadlines(cfg).step, next_step=self._after_stall, show=self._bar.note)
                run.progress.before_announce = self._before_epoch_line
            from pipeline.launch.monitor import training_monitor

            self.monitor = training_monitor(cfg, snapshot=self._best_snapshot, abort=self.server.fail,
                                            stoppable=run.stoppable)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _build_server(self, settings):
        """The run's parameter server (staged with pipeline stages), not started."""
        from pipeline.launch.sparse_tables import sparse_store
        from pipeline.ps import ParameterServer

        run, cfg = self.run, self.run.cfg
        common = dict(secret=self._secret, host=self._host, generation=1, on_metrics=run.progress, tls=self._tls)
        self.sparse = sparse_store(cfg, run.spec, cfg.parallelism.tasks)  # ps.sparse: None without tables
        if cfg.parallelism.pipeline > 1:
            from pipeline.ps.server.staged import StagedParameterServer

            ranges = stage_ranges(run)
            log.info("pipeline parallelism: %d replicas x %d stages (parameter slices %s), %d micro-batches",
                     cfg.parallelism.data, cfg.parallelism.pipeline, ranges, cfg.parallelism.micro_batches)
            return StagedParameterServer(run.initial, ranges, settings, replicas=cfg.parallelism.data,
                                         stage_buffers=run.stage_buffer_stores(), **common)
        return ParameterServer(run.initial, settings, world_size=cfg.parallelism.tasks, buffers=run.buffer_store(),
                               sparse=self.sparse, **common)

    @property
    def keeps_sparse_tables(self) -> bool:
        """The server keeps sparse tables whose trained rows go next to the model when training ends."""
        return self.sparse is not None

    def on_epoch(self, row: dict) -> None:
        from pipeline.launch.monitor import epoch_lr

        lr = epoch_lr(self.run.cfg, row, self.server.version, self.run.steps_per_epoch, self.run.step_offset)
        if lr is not None:
            row["lr"] = lr  # the row is the history's: the rate reaches the epoch metrics and the curves
        if self.run.cfg.train.profile:  # the server's side of the epoch's breakdown, as ps/*_ms
            from pipeline.ps.server.timing import EpochTiming

            self._server_timing = self._server_timing or EpochTiming()
            row.update(self._server_timing.row(self.server.stats))
        if self._bar is not None:
            self._bar.update_loss(row)
        if self.monitor is not None:
            self.monitor.on_epoch(row)

    def request_stop(self, kind: str, reason: str, epoch: int) -> None:
        """The caller's stop (TrainingRun.stoppable), through the monitor: the best epoch so far is kept."""
        if self.monitor is None:
            log.warning("cannot stop training early (%s): the run was not started stoppable", reason)
            return
        self.monitor.request_stop(kind, reason, epoch)

    def _best_snapshot(self) -> dict:
        """The PS state now (an epoch just completed), with the epoch reports and the run's record."""
        return {"step": int(self.server.version), "ps": self.server.state_dict(), **self.run.progress.reports(),
                **self.run.checkpoint_meta.record()}

    def _snapshot(self) -> dict:
        from pipeline.launch.ps_side.snapshot import take_snapshot

        meta = self.run.checkpoint_meta
        return take_snapshot(self.server, self.run.progress, self.server.consistency, meta.steps_per_epoch,
                             meta.epochs, **meta.record())

    def run_attempt(self, attempt: int) -> list[dict]:
        """One barrier job against this PS; raises WorkerTrainingFailedError naming the root-cause rank(s)."""
        from pipeline.launch.task.body import TaskWiring

        run, cfg, server = self.run, self.run.cfg, self.server
        plans = worker_plans(cfg, run.manifest, run.spec, run.steps_per_epoch, server.generation, attempt,
                             getattr(server, "addresses", None), stream=run.stream)
        return self._run_job(attempt, plans, TaskWiring(self._secret, cfg.train.log_tail_lines,
                                                        ps=tuple(server.address), tls=self._tls))

    def _run_job(self, attempt: int, plans: list, wiring, guards: tuple = ()) -> list[dict]:
        """The attempt's barrier job with the PS-side guards (and the placement's own ``guards``)."""
        from pipeline.launch.ps_side.watchdog import StageWatchdog
        from pipeline.launch.task.body import make_task_fn

        run, cfg, server = self.run, self.run.cfg, self.server
        task_fn = make_task_fn(plans, wiring)
        tag = new_tag()
        watchdog = StageWatchdog(server, cfg.parallelism.tasks, connect_timeout_s=deadlines(cfg).connect,
                                 grace_s=failed_attempt_grace(cfg), cancel=lambda reason: _cancel(run.spark, tag))
        log.info("barrier attempt %d (generation %d) from step %d", attempt, server.generation, server.version)
        self._attempt = attempt
        guards = (*guards, watchdog, self._bar) + ((self._stall,) if self._stall is not None else ())
        try:
            rows = run_barrier_job(run.spark, task_fn, cfg.parallelism.tasks, tag=tag, guards=guards,
                                   on_job_error=lambda exc: self._job_failure(exc, attempt, watchdog))
            raise_for_failed_rows(rows, list(server.root_failures), attempt, first_cause_only=run.allreduce)
        except WorkerTrainingFailedError as failure:
            if self.monitor is not None and self.monitor.accounts_for(failure):
                return []  # the monitor stopped training (or the guard took a NaN): the best epoch is the result
            died = getattr(server, "failure_cause", None)  # ps.server_processes: a shard process died
            if died:
                raise WorkerTrainingFailedError(failure.failures, attempt, failure.cause, failure.stopped,
                                                server_error=died) from failure
            raise
        return rows

    def _before_epoch_line(self, row: dict) -> None:
        row.update(self._stall.epoch_metrics())
        self._checkpointer.summary()  # this epoch's checkpoints, one INFO line before the epoch's

    def _after_stall(self) -> str:
        """What the driver does once the step deadline fails a stalled attempt, for the stall WARNING."""
        most = self.run.cfg.train.max_attempts
        if self._attempt >= most:
            return f"the run fails: attempt {self._attempt} is the last that train.max_attempts={most} allows"
        return (f"attempt {self._attempt + 1} of {most} (train.max_attempts) starts from the parameter server's "
                "state, on the slots the cluster has then")

    def _job_failure(self, exc: BaseException, attempt: int, watchdog) -> WorkerTrainingFailedError:
        server = self.server
        if isinstance(exc, Exception):
            self._await_rank_failure(min(deadlines(self.run.cfg).step.seconds, RANK_FAILURE_WAIT_S))
        server.fail(f"the Spark barrier job failed: {spark_error_summary(exc)}")
        unknown = WorkerFailure(-1, watchdog.reason or "the barrier stage failed before any rank reported "
                                                       "(see the Spark error)")
        failures = server.root_failures or dict(server.failures) or {-1: unknown}
        return WorkerTrainingFailedError(failures, attempt, cause=watchdog.reason or spark_error_summary(exc))

    def _await_rank_failure(self, wait_s: float) -> None:
        """Give the PS a moment to hear which rank it was (a killed worker's connection drops at once, but
        the server's thread may not have recorded it yet): once the server is told the job failed, later
        drops count as consequences, not as the cause."""
        deadline = time.monotonic() + wait_s
        while not self.server.failures and time.monotonic() < deadline:
            time.sleep(0.02)

    def state_after_failure(self) -> StateAfterFailure:
        """The PS outlived the attempt; its state is usable unless its members were left at different
        versions (a step applied on some shards or stages only)."""
        if self.run.allreduce:
            return StateAfterFailure.NONE
        try:
            self.server.state_dict(timeout_s=STATE_CHECK_S)
        except PSError as exc:
            log.warning("the parameter server's state after the failed attempt is not consistent (%s); the retry "
                        "restarts it from the newest checkpoint", exc)
            return StateAfterFailure.CHECKPOINT
        return StateAfterFailure.KEPT

    def prepare_retry(self, attempt: int, failure: WorkerTrainingFailedError, verdict: Verdict) -> RetryStart:
        if verdict is Verdict.RETRY_FROM_PS_STATE:
            start = RetryStart(self.server.version, f"step {self.server.version} with the PS state kept")
            self._checkpointer.save(f"after failed attempt {attempt}")
        elif verdict is Verdict.RETRY_FROM_CHECKPOINT:
            start = self._restore_newest_checkpoint(attempt, failure)
        else:  # RETRY_FROM_START: allreduce replicas start over; the PS only carries metrics and failures
            start = RetryStart(0, "the start (allreduce keeps no state on the parameter server)")
        try:
            self.server.new_generation()
        except PSError as exc:
            raise _cannot_retry(failure, attempt, str(exc)) from failure
        if verdict is Verdict.RETRY_FROM_PS_STATE:
            self._close_abandoned_epochs()
        return start

    def _restore_newest_checkpoint(self, attempt: int, failure: WorkerTrainingFailedError) -> RetryStart:
        store = self.run.store
        latest = store.latest()
        if latest is None:
            raise _cannot_retry(failure, attempt, f"the parameter server's members disagree and {store.directory} "
                                                  "holds no checkpoint to restart from (train.checkpoint_every)")
        self.server.load_state_dict(store.load(latest)["ps"])
        return RetryStart(latest.step, f"checkpoint step {latest.step} (the PS state was not consistent)")

    def _close_abandoned_epochs(self) -> None:
        """Epochs a dead rank stepped past without reporting are summarized from the others (the retried
        rank starts after them and will not report them)."""
        from pipeline.launch.ps_side.snapshot import epochs_left_unreported

        run, cfg = self.run, self.run.cfg
        try:
            state = self.server.state_dict()
        except PSError:  # bookkeeping only: the retry itself does not depend on it
            log.warning("could not read the PS state to settle the epochs of the failed attempt", exc_info=True)
            return
        run.progress.close_abandoned(epochs_left_unreported(
            state, run.progress.reports(), self.server.consistency, run.progress.world_size,
            run.steps_per_epoch, cfg.train.epochs, offset=run.step_offset))

    def outcome(self, rows: list[dict]) -> Outcome:
        from pipeline.launch.merge import replica_buffers, replica_outcome

        run = self.run
        final = self.monitor.final() if self.monitor is not None else None
        if final is not None:
            return self._best_outcome(final, rows)
        if run.allreduce:
            parameters, version, expected = replica_outcome(rows, run.initial.numel(), run.cfg.parallelism.pipeline,
                                                            run.steps_per_epoch * run.cfg.train.epochs)
            buffers = replica_buffers(rows, run.initial_buffers.numel(), run.cfg.parallelism.pipeline)
        else:
            parameters, version, expected = self.server.parameters(), self.server.version, run.expected_version
            buffers = self.server.buffers()  # every rank pushed its buffers after its last epoch
        stats = dict(self.server.stats)
        self._checkpointer.save("end of training")
        return Outcome(parameters, version, expected, stats, rows, buffers)

    def _best_outcome(self, final, rows: list[dict]) -> Outcome:
        """The best epoch's parameters as the run's result; its state is also the newest checkpoint."""
        best = self.monitor.best
        log.warning("the run's model is epoch %d's (step %d, %s %.6g): %s", final.best_epoch + 1, final.best_step,
                    final.metric, final.best_value, final.reason)
        try:
            # Later checkpoints first: saved after them, the best (lowest step) would be the one pruned.
            moved = self.run.store.set_aside_after(int(best["step"]))
            info = self.run.store.save(best)
            log.info("checkpoint of the best epoch: %s%s", info.path,
                     f" ({moved} later checkpoint(s) moved to after_best/)" if moved else "")
        except Exception:  # the model is the result; a failed write only loses the resumable copy
            log.warning("could not write the best epoch's checkpoint to %s", self.run.store.directory, exc_info=True)
        import torch

        ps = best["ps"]  # a staged server's state holds one state per stage
        stages = [ps] if "params" in ps else ps["stages"]
        parameters = torch.cat([st["params"] for st in stages])
        # The buffers merged at that epoch's end (each rank pushes its own before its epoch report).
        kept = [st["buffers"] for st in stages if st.get("buffers") is not None]
        buffers = torch.cat(kept) if kept else None
        step = int(best["step"])
        return Outcome(parameters, step, step, dict(self.server.stats), rows, buffers, stopped=final.to_dict())
