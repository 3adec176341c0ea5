"""What every training loop of a task shares, flat or pipeline stage: the result it returns, the PS
session it runs in, its loader, its seed, its log stream to the driver and its fault hooks.

The loops (``loop``, ``stage_loop``) differ only in what one step does; everything around the steps
lives here once, so a change to e.g. how a failure reaches the server applies to both.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from pipeline.worker.plan import FaultPlan, WorkerPlan

if TYPE_CHECKING:  # keep torch and the client out of module import time
    from pipeline.data import StreamingLoader
    from pipeline.ps import PSClient, ServerInfo

log = logging.getLogger(__name__)

# How often a running epoch hands its buffered log lines to the driver (epoch reports carry the rest).
FORWARD_EVERY_S = 2.0


@dataclass(frozen=True)
class WorkerResult:
    rank: int
    steps: int
    samples: int
    seconds: float
    final_train_loss: float
    device: str = "cpu"
    # allreduce: sha256 of this rank's final parameters (replicas must agree) and, on rank 0, the
    # parameters themselves as raw little-endian float32 bytes (the merged model).
    parameters_digest: Optional[str] = None
    parameters: Optional[bytes] = None
    # allreduce, replica 0: its buffers' fp32 words (pipeline.models.state), the merged model's.
    buffers: Optional[bytes] = None


# -- seeding, loader -------------------------------------------------------------------------------
def seed_rank(plan: WorkerPlan) -> None:
    """Dropout masks (and any other torch randomness) differ per rank, reproducibly."""
    import torch

    torch.manual_seed(plan.seed + plan.rank)


def make_train_loader(plan: WorkerPlan, *, rank: Optional[int] = None,
                      fields: Optional[tuple[Optional[str], Optional[str]]] = None) -> StreamingLoader:
    """This rank's streaming loader: row groups read on demand, bounded shuffle buffer, prefetch thread,
    all set by ``plan.loader``.

    ``rank`` seeds the shuffle (default ``plan.rank``; a pipeline stage passes its replica, so the first
    and last stage of a replica draw the same rows). ``fields`` = (features, label) overrides the plan's
    columns; a None skips that column (a stage reads only what it needs)."""
    from pipeline.data import StreamingLoader

    features_field, label_field = fields if fields is not None else (plan.features_field, plan.label_field)
    loader = plan.loader
    return StreamingLoader(plan.train_files, steps_per_epoch=plan.steps_per_epoch, seed=plan.seed,
                           rank=plan.rank if rank is None else rank, features_field=features_field,
                           label_field=label_field, num_features=plan.num_features,
                           row_group_rows=loader.row_group_rows, shuffle=loader.shuffle,
                           shuffle_buffer_rows=loader.shuffle_buffer_rows, prefetch=loader.prefetch,
                           reader_threads=loader.reader_threads, reader=loader.reader,
                           features=plan.model.feature_set, world=loader.world, resumed=loader.resumed)


# -- the PS session --------------------------------------------------------------------------------
def _client(plan: WorkerPlan, host: str, port: int, secret: bytes, rank: int,
            log_tail: Optional[Callable[[], str]], tls=None) -> PSClient:
    from pipeline.ps import PSClient
    from pipeline.worker.sizes import expected_sizes

    params, buffer_words = expected_sizes(plan)  # every WELCOME is checked against this task's own model
    # Each wait's error names its own key: timeouts.step_s for a step, timeouts.connect_s for connecting.
    return PSClient(host, port, rank=rank, secret=secret, generation=plan.generation,
                    timeout_s=plan.deadlines.step, connect_timeout=plan.deadlines.connect, log_tail=log_tail,
                    expected_params=params, expected_buffer_words=buffer_words, tls=tls)


@contextmanager
def ps_session(plan: WorkerPlan, host: str, port: int, secret: bytes, *, rank: Optional[int] = None,
               log_tail: Optional[Callable[[], str]] = None, tls=None) -> Iterator[tuple[PSClient, ServerInfo]]:
    """Connected to the PS as ``rank`` (default ``plan.rank``; a stage is its replica on its stage's
    server) for the block; FINISH when the block completes.

    Connecting comes first, before anything that can fail; leaving on an exception sends FAIL (the
    client's exit), so the server frees the peers at once instead of letting them time out."""
    with _client(plan, host, port, secret, plan.rank if rank is None else rank, log_tail, tls) as client:
        info = client.connect()
        yield client, info
        client.finish()


@contextmanager
def failures_reported(client: PSClient) -> Iterator[None]:
    """FAIL for an exception of the block, sent before the caller's outer blocks unwind: a process
    group's or a stage link's teardown breaks the peers, and their FAILs must not reach the server
    ahead of this rank's cause."""
    try:
        yield
    except BaseException as exc:
        client.report_failure(exc)
        raise


# -- log forwarding --------------------------------------------------------------------------------
class LogForwarder(logging.Handler):
    """Buffers this worker's log lines for the driver; `take()` hands them over (best effort)."""

    def __init__(self, level: int, limit: int = 200):
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._lines: list[str] = []
        self._limit = limit
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if len(self._lines) < self._limit:
                self._lines.append(self.format(record))
            else:
                self.dropped += 1
        except Exception:  # a log line must never fail training
            pass

    def take(self) -> list[str]:
        lines, self._lines = self._lines, []
        if self.dropped:
            lines.append(f"({self.dropped} more log lines dropped)")
            self.dropped = 0
        return lines


class LogStream:
    """While training (the ``with`` block), rank 0's INFO lines and every rank's warnings go to the
    driver's log: every FORWARD_EVERY_S within an epoch (``tick``) and with each epoch report."""

    def __init__(self, client: PSClient, rank: int):
        self.client = client
        self.forwarder = LogForwarder(logging.INFO if rank == 0 else logging.WARNING)
        self._last = time.monotonic()

    def __enter__(self) -> LogStream:
        logging.getLogger("pipeline").addHandler(self.forwarder)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("pipeline").removeHandler(self.forwarder)

    def tick(self) -> None:
        if time.monotonic() - self._last > FORWARD_EVERY_S:
            lines = self.forwarder.take()
            if lines:
                try:
                    self.client.report({"log": lines})
                except Exception:  # best effort: streaming logs never fails the job
                    log.debug("could not forward %d log lines to the driver", len(lines), exc_info=True)
            self._last = time.monotonic()

    def report(self, metrics: dict) -> None:
        """An epoch's metrics, with the log lines buffered since the last hand-over."""
        self.client.report({**metrics, "log": self.forwarder.take()})
        self._last = time.monotonic()


# -- fault injection -------------------------------------------------------------------------------
class InjectedFault(RuntimeError):
    """Raised by the fault-injection hook (faults.fail_rank / faults.fail_step); off by default."""


class FaultHooks:
    """The ``faults.*`` hooks of this attempt for global rank ``rank`` (all off in a default FaultPlan)."""

    def __init__(self, faults: FaultPlan, rank: int, generation: int = 0):
        self.faults = faults
        self.rank = rank
        self.generation = generation  # the attempt's PS generation, in faults.record_rows_dir's records

    def before_step(self, step: int) -> None:
        faults, rank = self.faults, self.rank
        if faults.delay_rank == rank and step >= faults.delay_step:
            time.sleep(faults.delay_ms / 1000.0)
        if faults.kill_rank == rank and step >= faults.kill_step:
            import os
            import signal

            log.error("rank %d: faults.kill_rank: SIGKILL to this Python worker (pid %d) at step %d",
                      rank, os.getpid(), step)
            os.kill(os.getpid(), signal.SIGKILL)
        if faults.fail_rank == rank and not faults.fail_in_rendezvous and step >= faults.fail_step:
            raise InjectedFault(f"injected failure on rank {rank} at step {step} (faults.fail_rank)")
        if faults.slow_rank == rank:
            time.sleep(faults.slow_s)

    def exploding(self, step: int, loss):
        """``loss``, times faults.explode_factor on faults.explode_rank at faults.explode_step (one
        exploding step, whose gradient is that much larger: the divergence guard's drill)."""
        faults = self.faults
        if faults.explode_rank == self.rank and step == faults.explode_step:
            log.warning("rank %d: faults.explode_rank: loss x %g at step %d", self.rank, faults.explode_factor, step)
            return loss * faults.explode_factor
        return loss

    def applied(self, epoch: int, step: int, x, y) -> None:
        """faults.record_rows_dir: the rows of a step the server applied, as digests of their bytes."""
        if self.faults.record_dir is not None:
            from pipeline.worker.row_log import record_step

            record_step(self.faults.record_dir, self.rank, epoch, step, x, y, self.generation)

    def joining_group(self) -> None:
        """Before joining an allreduce process group (faults.fail_in_rendezvous)."""
        if self.faults.fail_in_rendezvous and self.faults.fail_rank == self.rank:
            raise InjectedFault(f"injected failure on rank {self.rank} while joining the allreduce process "
                                "group (faults.fail_in_rendezvous)")


# -- the result ------------------------------------------------------------------------------------
def final_parameters(module, *, keep: bool) -> tuple[str, Optional[bytes], Optional[bytes]]:
    """sha256 of ``module``'s flat parameters and, if ``keep``, the raw float32 bytes of its parameters
    and of its buffers' words (allreduce). Only parameters are hashed: each replica's buffers also saw its
    own last batch."""
    import hashlib

    from pipeline.models import flat_buffers, flat_parameters

    raw = flat_parameters(module).cpu().contiguous().numpy().tobytes()
    buffers = flat_buffers(module).contiguous().numpy().tobytes() if keep else None
    return hashlib.sha256(raw).hexdigest(), raw if keep else None, buffers
