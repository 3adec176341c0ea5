"""How a worker exchanges with the parameter server after each backward pass, one class per ``ps.mode``.

Why separate classes: the training loop (forward, backward, metrics) is the same in every mode; only
what happens after backward differs (push a gradient and wait, push and go on, or step locally and
push a parameter delta every ``sync_every`` steps). The mode itself comes from the server's WELCOME,
so driver and workers cannot disagree about it.

Each exchange tracks, per epoch, the seconds spent in PS calls (``wait_s``: transfer plus waiting for
peers) and the staleness of the parameters each gradient was computed on:
ssp: clocks the rank runs ahead of the applied version; async: versions applied between the rank's
pull and its push being applied; sync/average: 0.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep torch and the client out of module import time
    import torch

    from pipeline.ps import OptimizerSpec, PSClient, ServerInfo

log = logging.getLogger(__name__)


class ExchangeStats:
    """Per-epoch communication metrics; ``take()`` returns them and starts the next epoch."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self.staleness_sum = 0
        self.staleness_max = 0
        self.count = 0

    def record(self, staleness: int) -> None:
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.count += 1

    def take(self) -> dict[str, float]:
        out = {"wait_s": self.wait_s, "staleness_max": float(self.staleness_max),
               "staleness_mean": self.staleness_sum / self.count if self.count else 0.0}
        self.__init__()
        return out


class Exchange:
    """Base: ``start()`` loads the server's parameters and returns the first step; ``after_backward``
    does this mode's PS work for one step and returns the next step number.

    ``flat`` (the flat loop): the model's parameters and gradients become views of two flat buffers
    (``pipeline.worker.buckets.FlatModel``), so pulls land in the model and pushes read autograd's
    output with no copy; ``overlap`` (``ps.overlap``) also pushes each server slice during backward."""

    # Modes that push the gradient autograd left in .grad (average pushes a parameter delta instead).
    pushes_grad = False
    # ...and take the next parameters in the same round trip (PUSH_PULL; async: PUSH, then PULL).
    pulls = True

    def __init__(self, client: PSClient, info: ServerInfo, model, total_steps: int,
                 optimizer: OptimizerSpec, precision=None, *, flat: bool = False, overlap: bool = False) -> None:
        import torch

        from pipeline.worker.precision import Precision

        self.precision = precision or Precision()
        self.client = client
        self.info = info
        self.model = model
        self.total_steps = total_steps
        self.stats = ExchangeStats()
        self.grad = torch.empty(info.num_params, dtype=torch.float32)
        self.lap = _no_lap  # train.profile: the step timer's lap (pipeline.worker.timing)
        self.flat = self.pusher = None
        if flat and self.pushes_grad:
            from pipeline.worker.buckets import BucketPusher, FlatModel

            if FlatModel.bindable(model):
                self.flat = FlatModel(model, grad=client.grad_slot())
                client.use_params_buffer(self.flat.params)
                self.grad = self.flat.grad
                # One slice: nothing to send earlier than after backward. fp16: the push is unscaled first.
                if overlap and client.num_shards > 1 and not self.precision.scaled:
                    self.pusher = BucketPusher(client, self.flat, pull=self.pulls)

    def timed(self, timer):
        """Laps of this exchange's parts go to ``timer`` (and the client's send/receive split, when it
        is enabled: off, the client is left as it is). Returns ``timer``."""
        self.lap = timer.lap
        if timer.enabled:
            self.client.phase_hook = timer.lap
        return timer

    def _pull(self, wanted: int) -> tuple[int, torch.Tensor]:
        started = time.perf_counter()
        version, params = self.client.pull(wanted)
        self.stats.wait_s += time.perf_counter() - started
        self.lap("pull_wait")
        self._load(params)
        return version, params

    def _load(self, params: torch.Tensor) -> None:
        from pipeline.models import load_flat_parameters

        if self.flat is None:
            load_flat_parameters(self.model, params)
        elif params.data_ptr() != self.flat.params.data_ptr():  # the ring's memory, or the server's page
            if self.flat.binds:
                self.flat.bind_params(params)
            else:
                self.flat.params.copy_(params)
        self.lap("load_params")

    def _push(self, step: int, values: torch.Tensor) -> int:
        started = time.perf_counter()
        acked = self.client.push(step, values)
        self.stats.wait_s += time.perf_counter() - started
        self.lap("push")
        return acked

    def _push_pull(self, step: int, values: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Push ``step`` and pull version ``step + 1`` in one round trip (sync/ssp/average)."""
        started = time.perf_counter()
        version, params = self.client.push_pull(step, values)  # laps push (the client's hook), pull_wait
        self.stats.wait_s += time.perf_counter() - started
        self.lap("pull_wait")
        self._load(params)
        return version, params

    def _round(self, step: int):
        """ps.overlap: the buckets backward has not sent yet, then the round's replies (``push_pull``'s or
        ``push``'s return value). The buckets sent during backward are timed as backward."""
        finite = self.precision.unscale_for_push(self.model)  # True: the pusher only runs unscaled
        assert finite and self.pusher is not None
        self.lap("grad_flatten")
        started = time.perf_counter()
        result = self.pusher.flush()  # laps push (the client's hook) once every bucket is out
        self.stats.wait_s += time.perf_counter() - started
        self.lap("pull_wait")
        if self.pulls:
            self._load(result[1])
        return result

    def zero_grad(self) -> None:
        """Before a step's backward: gradients start from zero (one memset of the flat buffer when bound)."""
        if self.flat is not None:
            self.flat.zero_grad()
        else:
            for p in self.model.parameters():
                p.grad = None

    def before_backward(self, step: int) -> None:
        """ps.overlap: buckets of this step may go out from now on (as backward fills them)."""
        if self.pusher is not None:
            self.pusher.arm(step)

    def _gradients(self) -> torch.Tensor:
        from pipeline.models.flat import flat_gradients

        finite = self.precision.unscale_for_push(self.model)  # fp16: true gradients, or zeros on overflow
        if self.flat is None:
            grad = flat_gradients(self.model, out=self.grad)
        elif not self.flat.intact():  # a hook replaced a .grad: copy, and views again for the next step
            self.flat.rebind_grads()
            grad = self.grad
        else:
            grad = self.grad  # autograd accumulated into the pushed buffer itself
        self.lap("grad_flatten")
        return grad if finite else grad.zero_()

    def start(self) -> int:
        raise NotImplementedError

    def after_backward(self, step: int) -> int:
        raise NotImplementedError

    # -- buffers (BatchNorm running statistics, ...: pipeline.models.state, pipeline.ps.state.buffers) --------
    def begin(self) -> int:
        """``start()``, then the server's merged buffers into the model: the initial model's on a fresh
        run, the last epoch end's on a retried attempt or a resume. Returns the first step."""
        step = self.start()
        if self.info.buffer_words:
            from pipeline.models.state import flat_buffers, load_flat_buffers

            mine = flat_buffers(self.model).numel()
            if mine != self.info.buffer_words:
                raise ValueError(f"this worker's model has {mine} buffer words, the parameter server keeps "
                                 f"{self.info.buffer_words}; driver and workers built different models")
            started = time.perf_counter()
            load_flat_buffers(self.model, self.client.pull_buffers())
            self.stats.wait_s += time.perf_counter() - started
        return step

    def end_epoch(self, step: int) -> None:
        """A sync point for buffers: this replica's buffers to the server, which keeps every rank's latest
        and merges them (after the last epoch: the final model's). Sent before the epoch's report, so a
        checkpoint taken once every rank reported the epoch holds them."""
        if not self.info.buffer_words:
            return
        from pipeline.models.state import flat_buffers

        started = time.perf_counter()
        self.client.push_buffers(step, flat_buffers(self.model))
        self.stats.wait_s += time.perf_counter() - started


class SyncExchange(Exchange):
    """BSP: push step t, wait for version t+1 (every rank's gradient averaged and applied)."""

    pushes_grad = True

    def start(self) -> int:
        version, _ = self._pull(0)
        return version

    def after_backward(self, step: int) -> int:
        version, _ = self._round(step) if self.pusher else self._push_pull(step, self._gradients())
        self.stats.record(0)
        return version


class SspExchange(Exchange):
    """Bounded staleness: push clock c, then wait (server side) until c+1 is within the bound."""

    pushes_grad = True

    def start(self) -> int:
        clock = self.info.clock
        version, _ = self._pull(clock)
        self.stats.record(clock - version)
        return clock

    def after_backward(self, step: int) -> int:
        version, _ = self._round(step) if self.pusher else self._push_pull(step, self._gradients())
        self.stats.record(step + 1 - version)
        return step + 1


class AsyncExchange(Exchange):
    """Downpour: push (applied at once), then take whatever version is current; never waits for peers."""

    pushes_grad = True
    pulls = False

    def start(self) -> int:
        self.pulled, _ = self._pull(0)
        return self.info.clock

    def after_backward(self, step: int) -> int:
        applied_to = self._round(step) if self.pusher else self._push(step, self._gradients())
        self.stats.record(applied_to - self.pulled)
        self.pulled, _ = self._pull(0)
        return step + 1


class AverageExchange(Exchange):
    """Local SGD: a local optimizer every step; every ``sync_every`` steps (and after the last) push
    ``local - last average`` and continue from the new average. Local optimizer state is kept."""

    def __init__(self, client: PSClient, info: ServerInfo, model, total_steps: int,
                 optimizer: OptimizerSpec, precision=None, **binding) -> None:
        super().__init__(client, info, model, total_steps, optimizer, precision, **binding)
        from pipeline.worker.precision import LocalOptimizer

        self.optimizer = LocalOptimizer(optimizer, model.parameters(), self.precision)
        self.base = self.grad.clone()
        self.local_steps = 0
        self.round = 0

    def start(self) -> int:
        self.round, params = self._pull(0)
        self.base.copy_(params)
        # Rounds end every sync_every local steps: a retried attempt restarts after the last applied
        # round (local steps since then were never merged, so they are redone, not lost).
        self.local_steps = min(self.round * self.info.sync_every, self.total_steps)
        return self.local_steps

    def after_backward(self, step: int) -> int:
        from pipeline.ps.modes.consistency import is_sync_point

        self.optimizer.step(self.local_steps)
        self.lap("exchange_other")
        self.local_steps += 1
        if is_sync_point(self.local_steps, self.total_steps, self.info.sync_every):
            delta = _flat_parameters_into(self.model, self.grad).sub_(self.base)
            self.lap("grad_flatten")
            self.round, params = self._push_pull(self.round, delta)
            self.base.copy_(params)
        self.stats.record(0)
        return step + 1


class AllreduceExchange(Exchange):
    """Peer to peer: DistributedDataParallel has already averaged the gradients across ranks during
    backward (bucketed, overlapped with it), so each rank steps its own replica with the same update and
    the replicas stay identical. The PS connection only carries metrics and failures."""

    def __init__(self, client: PSClient, info: ServerInfo, model, total_steps: int,
                 optimizer: OptimizerSpec, precision=None, **binding) -> None:
        super().__init__(client, info, model, total_steps, optimizer, precision, **binding)
        from pipeline.worker.precision import LocalOptimizer

        # Steps after DDP's allreduce: clipping sees the averaged gradient, the same on every replica.
        self.optimizer = LocalOptimizer(optimizer, model.parameters(), self.precision)

    def start(self) -> int:
        # Every replica starts from the server's initial parameters (DDP also broadcasts rank 0's).
        self._pull(0)
        return 0

    def after_backward(self, step: int) -> int:
        self.optimizer.step(step)
        self.stats.record(0)
        return step + 1

    def end_epoch(self, step: int) -> None:
        """Nothing: the merged model is replica 0's (its buffers are what DDP broadcasts to every replica
        before each forward), returned in its result row, not kept by the server."""


def _no_lap(phase: str) -> None:
    pass


def _flat_parameters_into(model, out: torch.Tensor) -> torch.Tensor:
    """The model's parameters into a preallocated flat vector (``model.parameters()`` order)."""
    import torch

    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            out[offset:offset + n].copy_(p.reshape(-1))
            offset += n
    return out


EXCHANGES: dict[str, type[Exchange]] = {"sync": SyncExchange, "ssp": SspExchange, "async": AsyncExchange,
                                        "average": AverageExchange}


def make_exchange(client: PSClient, info: ServerInfo, model, total_steps: int, optimizer: OptimizerSpec,
                  backend: str = "ps", precision=None, *, flat: bool = False, overlap: bool = False) -> Exchange:
    if backend == "allreduce":
        return AllreduceExchange(client, info, model, total_steps, optimizer, precision)
    try:
        cls = EXCHANGES[info.mode]
    except KeyError:
        raise ValueError(f"the parameter server runs ps.mode={info.mode!r}, which this worker does not know; "
                         "driver and workers must run the same shardline version") from None
    return cls(client, info, model, total_steps, optimizer, precision, flat=flat, overlap=overlap)
