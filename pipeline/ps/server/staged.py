"""The parameter server keyed by pipeline stage: one ``ParameterServer`` per stage, one driver-facing API.

Why one server per stage: with ``parallelism.pipeline = P`` a stage's parameters are a contiguous slice
of the whole model's flat vector (stages are contiguous runs of an ``nn.Sequential``), and only the D
replicas of that stage push gradients for it. A per-stage server sees exactly those D workers (ranks
0..D-1 = the replica index), so sync averaging, optimizer state, ``ps.shards``, checkpoints and failure
handling work unchanged inside each stage; this facade maps stage-local ranks to global barrier ranks
(``replica * P + stage``) and presents the ``ParameterServer`` API the launcher, watchdog and
checkpointer use. Because every supported optimizer is elementwise, stepping each stage's slice is
exactly stepping the whole vector.

A failed stage worker closes its links, so its neighbours fail at once ("pipeline link ... broke"),
and each stage server releases that stage's other replicas; stages are deliberately not aborted from
here, because an abort could refuse a push already in flight and leave the stages one step apart. The
root cause is the first failure, in arrival order across stages, that is a worker's own error rather
than a broken link its neighbours saw as a consequence.

Known limit (as with ``ps.shards``): a worker that dies between sending its activation gradients
upstream and pushing its own gradient leaves its stage one step behind the others; ``new_generation``
then refuses to continue (resume from a checkpoint instead of training on mixed parameters).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from pipeline.errors import PSError, WorkerFailure
from pipeline.ps.state.buffers import BufferStore
from pipeline.ps.server.failures import FailureObserver
from pipeline.ps.server.fanout import MixedVersionsText, ServerGroup
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.server.parameter_server import ParameterServer
from pipeline.ps.settings import PSSettings

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import ServerCert

log = logging.getLogger(__name__)

# Text a stage worker puts in its error when a neighbour stage's link broke: a consequence, not a cause.
LINK_CONSEQUENCE = "pipeline link"
# Errors a stage worker raises because of another stage's failure (see worker.stage_loop).
CONSEQUENCE_MARKERS = (LINK_CONSEQUENCE, "stage group allreduce")
_SUMMED_STATS = ("bytes_received", "bytes_sent", "push_payload_bytes")


class StagedParameterServer:
    """P per-stage servers over the slices ``stage_ranges`` of ``initial`` (see module docstring)."""

    def __init__(self, initial: torch.Tensor, stage_ranges: list[tuple[int, int]], settings: PSSettings, *,
                 replicas: int, secret: bytes, host: str, generation: int = 1,
                 on_metrics: Optional[Callable[[int, dict], None]] = None,
                 stage_buffers: Optional[list[Optional[BufferStore]]] = None, tls: Optional[ServerCert] = None) -> None:
        flat = initial.detach().to(torch.float32).reshape(-1)
        if stage_ranges[0][0] != 0 or stage_ranges[-1][1] != flat.numel() or any(
                a[1] != b[0] for a, b in zip(stage_ranges, stage_ranges[1:])):
            raise PSError(f"stage ranges {stage_ranges} must tile the {flat.numel()} parameters in order")
        self.stages = len(stage_ranges)
        self.replicas = replicas
        self.stage_ranges = list(stage_ranges)
        self._lock = threading.Lock()
        # Every failure on any stage, in arrival order, with its stage server's consequence verdict.
        self._arrivals: list[tuple[WorkerFailure, bool]] = []
        self._servers = [
            ParameterServer(flat[start:end].clone(), settings.for_slice(end - start), world_size=replicas,
                            secret=secret, host=host, generation=generation,
                            on_metrics=self._metrics_sink(stage, on_metrics),
                            on_failure=self._failure_sink(stage),
                            # Each stage's buffers belong to that stage's server.
                            buffers=stage_buffers[stage] if stage_buffers else None, tls=tls)
            for stage, (start, end) in enumerate(stage_ranges)
        ]
        self._group = ServerGroup(self._servers, name="pipeline stages", rank_of=self.global_rank,
                                  mixed=MixedVersionsText("stages", "", "restart from a checkpoint"))

    def global_rank(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def _metrics_sink(self, stage: int, on_metrics: Optional[Callable[[int, dict], None]]):
        if on_metrics is None:
            return None
        return lambda replica, metrics: on_metrics(self.global_rank(stage, replica), metrics)

    def _failure_sink(self, stage: int) -> FailureObserver:
        def on_failure(failure: WorkerFailure, consequence: bool) -> None:
            rank = self.global_rank(stage, failure.rank)
            with self._lock:
                self._arrivals.append((dataclasses.replace(failure, rank=rank), consequence))
        return on_failure

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "StagedParameterServer":
        self._group.start()
        log.info("parameter server: %d stage servers %s", self.stages,
                 ", ".join(f"stage {i} {s.address[0]}:{s.address[1]}[{a},{b})"
                           for i, (s, (a, b)) in enumerate(zip(self._servers, self.stage_ranges))))
        return self

    def __enter__(self) -> "StagedParameterServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._group.close()

    def fail(self, reason: str) -> None:
        self._group.fail(reason)

    def new_generation(self, generation: int | None = None) -> int:
        new = self._group.new_generation(generation, refuse_mixed_versions=True)
        with self._lock:
            self._arrivals.clear()
        return new

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Each stage server's address, in stage order (stage p's workers connect to entry p)."""
        return [s.address for s in self._servers]

    @property
    def address(self) -> tuple[str, int]:
        return self._servers[0].address

    @property
    def version(self) -> int:
        return self._group.version

    @property
    def generation(self) -> int:
        return self._group.generation

    @property
    def num_params(self) -> int:
        return self.stage_ranges[-1][1]

    @property
    def consistency(self) -> Consistency:
        return self._servers[0].consistency

    def parameters(self) -> torch.Tensor:
        """The whole model's flat parameters: the stages' slices concatenated in stage order."""
        return torch.cat([s.parameters() for s in self._servers])

    def buffers(self) -> torch.Tensor:
        """The whole model's merged buffer words: the stages' in stage order (``named_buffers`` order of
        the whole Sequential, as for the parameters)."""
        return torch.cat([s.buffers() for s in self._servers])

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        return self._group.failures

    @property
    def root_failures(self) -> dict[int, WorkerFailure]:
        """The first failure, across stages, that is not a broken pipeline link (those are what the
        failed stage's neighbours see), else the first failure."""
        with self._lock:
            arrivals = list(self._arrivals)
        own = [f for f, consequence in arrivals
               if not consequence and not any(marker in f.error for marker in CONSEQUENCE_MARKERS)]
        chosen = (own or [f for f, _ in arrivals])[:1]
        return {f.rank: f for f in chosen}

    @property
    def silences(self) -> dict[int, tuple[float, str]]:
        """{rank: (seconds since it was last heard, host)} of the ranks connected now."""
        return self._group.silences

    @property
    def registered_ranks(self) -> set[int]:
        return self._group.registered_ranks

    @property
    def finished_ranks(self) -> set[int]:
        return self._group.finished_ranks

    @property
    def aborted(self) -> bool:
        return self._group.aborted

    @property
    def stats(self) -> dict[str, Any]:
        per = [s.stats for s in self._servers]
        merged = self._group.summed_stats(per, _SUMMED_STATS)
        merged["steps_applied_by_rank"] = {
            self.global_rank(stage, replica): steps
            for stage, p in enumerate(per) for replica, steps in p.get("steps_applied_by_rank", {}).items()}
        merged["stages"] = self.stages
        merged["by_stage"] = per
        return merged

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Every stage's state at one version: stages apply a step at different moments (the last stage
        first), so the snapshot is retaken until they agree; a resume needs them in step."""
        states = self._group.consistent_states(lambda s: s.state_dict(timeout_s), timeout_s, must_agree=True)
        return {"version": states[0]["version"], "stages": states,
                "stage_ranges": [list(r) for r in self.stage_ranges]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if [tuple(r) for r in state.get("stage_ranges", [])] != self.stage_ranges:
            raise PSError(f"the checkpoint was cut into stages {state.get('stage_ranges')}, this run into "
                          f"{self.stage_ranges}; use the same parallelism.pipeline/cuts or start fresh")
        versions = sorted({st["version"] for st in state["stages"]})
        if len(versions) != 1:
            raise PSError(f"the checkpoint holds pipeline stages at different versions {versions}; resume from "
                          "an earlier checkpoint")
        for server, st in zip(self._servers, state["stages"]):
            server.load_state_dict(st)
