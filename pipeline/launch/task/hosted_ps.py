"""In rank 0's barrier task (``ps.placement: task``): the parameter server hosted there.

Why: on some clusters executors cannot open connections to the driver (or to a Spark Connect client on a
laptop), but tasks of one barrier stage can reach each other. Rank 0's task then runs the same
``ParameterServer`` (same wire, authentication, modes, shards), with the same checkpointer and stage
watchdog the driver would run, announces its address with the barrier's one allGather, trains as a worker
itself, waits for the other ranks to finish, and returns the final parameters and the run's per-epoch
history as result rows. Nothing here touches the SparkSession.

A retry starts a fresh server from the newest checkpoint (the task saves one when an attempt fails while
it still runs, and every ``train.checkpoint_every`` steps), since the previous attempt's server died with
its task.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from pipeline.checkpoints import CheckpointMeta
from pipeline.launch.task.rows import embed_failure_report, encode_report
from pipeline.models import ModelSpec
from pipeline.ps.settings import PSSettings
from pipeline.wire.deadline import Timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostedPSSpec:
    """Everything rank 0's task needs to start the PS: typed plain values (shipped in the task closure)."""

    world_size: int
    generation: int
    settings: PSSettings
    backend: str
    # A failed attempt's tasks get this long to stop; the connect deadline; ranks' progress after rank 0 is done.
    grace: Timeout
    connect: Timeout
    peers: Timeout
    model: ModelSpec
    checkpoint_dir: str
    keep_checkpoints: int
    checkpoint_every: int
    checkpoint_every_s: Optional[float]
    # What every checkpoint records (fingerprint, model, layout, this launch's id...); also where the run's
    # epochs, steps per epoch and seed come from.
    checkpoint_meta: CheckpointMeta
    # The checkpoint to start from (a retry or --resume), else the seeded initialization / warm start.
    resume_path: Optional[str] = None
    warm_start: Optional[bytes] = None
    # The model's initial (or warm-start) buffers as fp32 words (pipeline.models.state); empty: none.
    buffers: bytes = b""

    @property
    def checkpoints_enabled(self) -> bool:
        return self.backend != "allreduce"  # allreduce keeps no state on the server


class PeersStuckError(RuntimeError):
    """Raised by rank 0's task when ranks neither finished nor failed by the deadline: failing the task
    makes Spark tear the whole barrier stage down (the stuck tasks included), which the driver cannot do
    for a task-hosted PS. The message carries the PS's failure account, compact, for the driver."""


class HostedPS:
    """The PS, its checkpointer and watchdog in rank 0's task; a context manager that tears all down."""

    def __init__(self, spec: HostedPSSpec, host: str, secret: bytes, *, tls=None):
        self.spec = spec
        self._host = host
        self._secret = secret
        self._tls = tls  # ps.tls: pipeline.wire.tls.ServerCert
        self._stack = None
        self.server = None
        self.progress = None
        self.checkpointer = None

    def __enter__(self) -> "HostedPS":
        from contextlib import ExitStack

        import torch

        from pipeline.checkpoints import CheckpointInfo, Checkpointer, CheckpointStore
        from pipeline.launch.ps_side.progress import EpochProgress
        from pipeline.models import build_model, flat_parameters
        from pipeline.launch.ps_side.buffers import buffer_store
        from pipeline.ps import ParameterServer

        spec = self.spec
        from pipeline.ps.state.sharded import merge_checkpoint_parts

        store = CheckpointStore(spec.checkpoint_dir, spec.keep_checkpoints, merge_parts=merge_checkpoint_parts)
        state = store.load(CheckpointInfo(spec.resume_path, -1)) if spec.resume_path else None
        if spec.warm_start is not None:
            initial = torch.frombuffer(bytearray(spec.warm_start), dtype=torch.float32)
        else:
            torch.manual_seed(spec.checkpoint_meta.seed)  # the same initialization the driver placement uses
            initial = flat_parameters(build_model(spec.model))
        self.progress = EpochProgress(spec.world_size, spec.checkpoint_meta.epochs)
        self._stack = ExitStack()
        try:
            self.server = self._stack.enter_context(ParameterServer(
                initial, spec.settings, world_size=spec.world_size, secret=self._secret, host=self._host,
                generation=spec.generation, on_metrics=self.progress, tls=self._tls,
                buffers=buffer_store(build_model(spec.model),
                                     torch.frombuffer(bytearray(spec.buffers), dtype=torch.float32))
                if spec.buffers else None))
            if state is not None:
                self.server.load_state_dict(state["ps"])
                self.progress.restore(state)
                log.info("task PS resuming from %s at step %d", spec.resume_path, self.server.version)
            self.checkpointer = self._stack.enter_context(Checkpointer(
                store, self._snapshot, lambda: self.server.version, spec.checkpoint_every,
                every_s=spec.checkpoint_every_s, enabled=spec.checkpoints_enabled))
            self.progress.before_announce = lambda row: self.checkpointer.summary()
        except BaseException:
            self._stack.close()
            raise
        log.info("parameter server in rank 0's task on %s:%d (generation %d, from step %d)", *self.server.address,
                 spec.generation, self.server.version)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def watch(self) -> None:
        """Start the stage watchdog (connect deadline, failed-attempt grace) once every task has passed
        the rendezvous, so the connect deadline does not also pay for the allGather."""
        from pipeline.launch.ps_side.watchdog import StageWatchdog

        spec = self.spec
        self._stack.enter_context(StageWatchdog(self.server, spec.world_size, connect_timeout_s=spec.connect,
                                                grace_s=spec.grace, cancel=lambda reason: None))

    def _snapshot(self) -> dict:
        from pipeline.launch.ps_side.snapshot import take_snapshot

        meta = self.spec.checkpoint_meta
        return take_snapshot(self.server, self.progress, self.spec.settings.consistency, meta.steps_per_epoch,
                             meta.epochs, **meta.record())

    def finish(self, row: dict) -> dict:
        """After rank 0's own worker is done: wait for the peers, then put the PS's account (and, with the
        PS backend, the final parameters) into rank 0's row; raise PeersStuckError when ranks hang."""
        self.wait_for_peers()
        report = self.report(failed=not row["ok"])
        stuck = self.stuck_ranks()
        if stuck:
            if not row["ok"]:  # rank 0's own error says more than the PS's "closed its connection"
                report["failures"]["0"] = [row["error"], row["log_tail"] or "", row["retryable"] is not False]
            reason = (f"rank(s) {stuck} neither finished nor failed within {self.spec.peers.seconds:g}s "
                      f"({self.spec.peers.key}) after the attempt failed; rank 0 (which hosts the PS) stopped the "
                      "barrier stage")
            raise PeersStuckError(embed_failure_report(reason, report))
        row = {**row, "ps_report": encode_report(report)}
        if self.spec.backend == "ps":
            row["parameters"] = self.server.parameters().contiguous().numpy().tobytes()
            row["buffers"] = self.server.buffers().contiguous().numpy().tobytes()
        return row

    def wait_for_peers(self) -> None:
        """Wait until every rank finished or the attempt failed. The deadline is spec.peers without
        progress (no step applied, no rank finishing), so a slow async peer keeps its time while a dead
        one cannot hold the task."""
        server, everyone, limit = self.server, set(range(self.spec.world_size)), self.spec.peers
        last_change, last_seen = time.monotonic(), None
        while True:
            done = server.finished_ranks | set(server.failures)
            if done >= everyone or server.aborted:
                return
            seen = (server.version, len(done))
            if seen != last_seen:
                last_change, last_seen = time.monotonic(), seen
            elif time.monotonic() - last_change > limit.seconds:
                missing = sorted(everyone - done)
                server.fail(f"rank(s) {missing} neither finished nor made progress within {limit.seconds:g}s "
                            f"after rank 0 finished; {limit.hint}")
                return
            time.sleep(0.05)

    def report(self, failed: bool) -> dict:
        """The PS's account of the attempt for the driver (JSON-able); saves a checkpoint on the way out."""
        why = "after a failed attempt" if failed or self.server.failures or self.server.aborted else "end of training"
        self.checkpointer.save(why)
        return {
            "version": self.server.version,
            "generation": self.server.generation,
            "history": self.progress.history,
            "stats": self.server.stats,
            "root_failures": list(self.server.root_failures),
            "failures": {str(rank): [f.error, f.log_tail or "", f.retryable]
                         for rank, f in self.server.failures.items()},
            "checkpoints": list(self.checkpointer.saved),
            "address": "%s:%d" % self.server.address,
        }

    def stuck_ranks(self) -> list[int]:
        """Ranks that neither finished nor reported a failure (e.g. a task blocked in a hung read). Rank 0
        is never among them: its own outcome is in its row, and the server may not have seen its
        disconnect yet."""
        done = self.server.finished_ranks | set(self.server.failures)
        return sorted(set(range(1, self.spec.world_size)) - done)
