"""`ps.placement: task`: the parameter server hosted inside rank 0's barrier task.

Why: on some clusters executors cannot open connections to the driver (or to a Spark Connect client
on a laptop), but tasks of one barrier stage can reach each other. Rank 0's task then runs the same
`ParameterServer` (same wire, authentication, modes, shards), with the same checkpointer and stage
watchdog the driver would run, announces its address with the barrier's one allGather, trains as a
worker itself, waits for the other ranks to finish, and returns the final parameters and the run's
per-epoch history as result rows. Nothing here touches the SparkSession: it runs in the executor.

A retry starts a fresh server from the newest checkpoint (the task saves one when an attempt fails
while it still runs, and every `train.checkpoint_every` steps), since the previous attempt's server
died with its task.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostedPSSpec:
    """Everything rank 0's task needs to start the PS: plain values only (shipped in the task closure)."""

    world_size: int
    epochs: int
    steps_per_epoch: int
    generation: int
    optimizer: dict
    consistency: dict
    compression: str
    topk_ratio: float
    shards: int
    timeout_s: float
    grace_s: float
    model: dict
    seed: int
    checkpoint_dir: str
    keep_checkpoints: int
    checkpoint_every: int
    checkpoints_enabled: bool
    # The checkpoint to start from (a retry or --resume), else the seeded initialization / warm start.
    resume_path: Optional[str] = None
    warm_start: Optional[bytes] = None
    # Plain values every checkpoint records (fingerprint, world_size, mode, steps_per_epoch, extra...).
    checkpoint_meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class HostedPS:
    """The PS, its checkpointer and watchdog in rank 0's task; a context manager that tears all down."""

    def __init__(self, spec: HostedPSSpec, host: str, secret: bytes):
        self.spec = spec
        self._host = host
        self._secret = secret
        self._stack = None
        self.server = None
        self.progress = None
        self.checkpointer = None

    def __enter__(self) -> "HostedPS":
        from contextlib import ExitStack

        import torch

        from pipeline.checkpoints import CheckpointInfo, CheckpointStore
        from pipeline.launch.progress import EpochProgress
        from pipeline.launch.train import Checkpointer
        from pipeline.models import ModelSpec, build_model, flat_parameters
        from pipeline.ps import OptimizerSpec, ParameterServer
        from pipeline.ps.modes import Consistency

        spec = self.spec
        store = CheckpointStore(spec.checkpoint_dir, spec.keep_checkpoints)
        state = store.load(CheckpointInfo(spec.resume_path, -1)) if spec.resume_path else None
        if spec.warm_start is not None:
            initial = torch.frombuffer(bytearray(spec.warm_start), dtype=torch.float32)
        else:
            torch.manual_seed(spec.seed)  # the same initialization the driver placement uses
            initial = flat_parameters(build_model(ModelSpec.from_dict(spec.model)))
        self.progress = EpochProgress(spec.world_size, spec.epochs)
        optimizer = OptimizerSpec(**{**spec.optimizer, "betas": tuple(spec.optimizer.get("betas", (0.9, 0.999)))})
        self._stack = ExitStack()
        try:
            self.server = self._stack.enter_context(ParameterServer(
                initial, world_size=spec.world_size, secret=self._secret, optimizer=optimizer, host=self._host,
                timeout_s=spec.timeout_s, generation=spec.generation, on_metrics=self.progress,
                consistency=Consistency(**spec.consistency), compression=spec.compression,
                topk_ratio=spec.topk_ratio, shards=spec.shards))
            if state is not None:
                self.server.load_state_dict(state["ps"])
                self.progress.restore(state)
                log.info("task PS resuming from %s at step %d", spec.resume_path, self.server.version)
            self.checkpointer = self._stack.enter_context(Checkpointer(
                store, self._snapshot, lambda: self.server.version, spec.checkpoint_every,
                enabled=spec.checkpoints_enabled))
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
        from pipeline.launch.watchdog import StageWatchdog

        spec = self.spec
        self._stack.enter_context(StageWatchdog(self.server, spec.world_size, connect_timeout_s=spec.timeout_s,
                                                grace_s=spec.grace_s, cancel=lambda reason: None))

    def _snapshot(self) -> dict:
        from pipeline.launch.snapshot import take_snapshot
        from pipeline.ps.modes import Consistency

        s = self.spec
        return take_snapshot(self.server, self.progress, Consistency(**s.consistency),
                             s.steps_per_epoch, s.epochs, model=s.model, epochs=s.epochs,
                             seed=s.seed, **s.checkpoint_meta)

    def wait_for_peers(self) -> None:
        """After rank 0's own worker is done: wait until every rank finished or the attempt failed.

        The deadline is ps.timeout_s without progress (no step applied, no rank finishing), so a slow
        async peer keeps its time while a dead one cannot hold the task.
        """
        server, everyone = self.server, set(range(self.spec.world_size))
        last_change, last_seen = time.monotonic(), None
        while True:
            done = server.finished_ranks | set(server.failures)
            if done >= everyone or server.aborted:
                return
            seen = (server.version, len(done))
            if seen != last_seen:
                last_change, last_seen = time.monotonic(), seen
            elif time.monotonic() - last_change > self.spec.timeout_s:
                missing = sorted(everyone - done)
                server.fail(f"rank(s) {missing} neither finished nor made progress within {self.spec.timeout_s:g}s "
                            "after rank 0 finished (ps.timeout_s)")
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
            "failures": {str(rank): [f.error, f.log_tail or ""] for rank, f in self.server.failures.items()},
            "checkpoints": list(self.checkpointer.saved),
            "address": "%s:%d" % self.server.address,
        }

    def stuck_ranks(self) -> list[int]:
        """Ranks that neither finished nor reported a failure (e.g. a task blocked in a hung read). Rank 0
        is never among them: its own outcome is in its row, and the server may not have seen its
        disconnect yet."""
        done = self.server.finished_ranks | set(self.server.failures)
        return sorted(set(range(1, self.spec.world_size)) - done)

    def parameters_bytes(self) -> bytes:
        return self.server.parameters().contiguous().numpy().tobytes()


def encode_report(report: dict) -> str:
    return json.dumps(report, default=str)


_REPORT_TAG = "shardline-task-ps-failure:"
_MAX_EMBEDDED = 6000


class PeersStuckError(RuntimeError):
    """Raised by rank 0's task when ranks neither finished nor failed by the deadline: failing the task
    makes Spark tear the whole barrier stage down (the stuck tasks included), which the driver cannot do
    for a task-hosted PS. The message carries the PS's failure account, compact, for the driver."""


def failure_error(report: dict, stuck: list[int]) -> PeersStuckError:
    import base64

    failures = {r: [e[:400], "\n".join((t or "").splitlines()[-15:])[:1500]]
                for r, (e, t) in list(report.get("failures", {}).items())[:8]}
    reason = (f"rank(s) {stuck} neither finished nor failed within ps.timeout_s after the attempt failed; "
              "rank 0 (which hosts the PS) stopped the barrier stage")
    compact = {"root_failures": report.get("root_failures", []), "failures": failures, "reason": reason}
    encoded = base64.b64encode(json.dumps(compact).encode())[:_MAX_EMBEDDED].decode()
    return PeersStuckError(f"{reason} {_REPORT_TAG}{encoded}")


def decode_failure_report(text: str) -> dict | None:
    """The compact failure account a PeersStuckError carried through Spark's error text, if any."""
    import base64
    import re

    found = re.search(re.escape(_REPORT_TAG) + r"([A-Za-z0-9+/=]+)", text)
    if not found:
        return None
    try:
        return json.loads(base64.b64decode(found.group(1)))
    except Exception:  # truncated on the way: the driver falls back to Spark's own error
        return None
