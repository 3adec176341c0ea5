"""The four consistency modes (``ps.mode``) on the server, one policy class each, in a table keyed by
mode that mirrors the worker's ``pipeline.worker.exchange.EXCHANGES`` (see ``modes`` for what each
mode means for the numbers a PUSH and a PULL carry).

* ``sync`` (BSP): every rank pushes its gradient for step ``t == version``; the last push of the step
  averages the sum (one preallocated buffer, one division), steps the optimizer and bumps the version,
  which releases the PULLs waiting for ``t + 1``. ``(rank, step)`` is applied at most once.
* ``average``: the BSP path of ``sync``; a complete step adds the mean parameter delta instead of
  stepping an optimizer.
* ``ssp``: each clock's gradients are summed in a ring of ``staleness + 1`` buffers and clocks are
  applied in order, once every rank pushed them; a PULL(c) waits until ``c - slowest <= staleness``.
* ``async``: each push is applied on arrival as one optimizer step.

In ssp and async each gradient is weighted by its staleness (``ps.staleness_scale``, see ``staleness``).

Every wait has a deadline (``PSSettings.step_timeout``) whose text names the ranks it waited for and
the key that raises it: a synchronous server must never hang on a dead worker. A rank that failed, or
finished while peers still need it, fails the waiters at once instead.
"""
from __future__ import annotations

import time
from typing import ClassVar

import torch

from pipeline.ps.modes.compression import Contribution, all_finite
from pipeline.ps.transport.connection import RankConnection, Roster
from pipeline.ps.state.core import ShardCore
from pipeline.ps.server.failures import FailureLedger
from pipeline.ps.server.messages import NONFINITE, TIMEOUT, Refusal
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.modes.staleness import scaled_step, weight
from pipeline.ps.server.stats import ShardStats
from pipeline.wire.deadline import deadline_after


class ConsistencyPolicy:
    """How one shard combines pushes into updates and when it answers a pull, for one ``ps.mode``.
    Called from connection threads; every method takes or expects the core's condition."""

    mode: ClassVar[str]
    # Whether a dense push may be summed where it lies in shared memory (``Contribution.in_place``).
    sums_in_place: ClassVar[bool] = False

    def __init__(self, core: ShardCore, roster: Roster, ledger: FailureLedger, stats: ShardStats,
                 consistency: Consistency) -> None:
        self.core = core
        self.roster = roster
        self.ledger = ledger
        self.stats = stats
        self.consistency = consistency
        self.world_size = roster.world_size
        self.timeout = core.step_timeout
        self.clock: dict[int, int] = {}  # ssp/async: steps pushed per rank in this generation

    # -- generation lifecycle (under the core's condition) ------------------------------------------
    def clock_on_connect_locked(self, rank: int) -> int:
        """The step a rank that connects now pushes next (announced in its WELCOME)."""
        return self.clock.setdefault(rank, 0)

    def pending_locked(self) -> int:
        """Pushes received for updates not applied yet (a checkpoint cannot be loaded meanwhile)."""
        return 0

    def new_generation_locked(self) -> int:
        """Forget the unfinished update (it is redone by the next attempt); returns its push count."""
        self.clock.clear()
        self.core.grad_sum.zero_()
        return 0

    def waiting_locked(self) -> dict[int, int]:
        return {}

    def checkpoint_clocks_locked(self) -> dict[int, int]:
        return {}

    def restore_clocks_locked(self, clocks: dict[int, int]) -> None:
        pass

    # -- requests ----------------------------------------------------------------------------------
    def refusal_locked(self, conn: RankConnection, stopped: str | None = None) -> str | None:
        """Why no request of ``conn`` can be served now (abort, stale generation, failed peer); ``stopped``
        names what a failed peer stops when that is not this mode's step or run (the allreduce meeting)."""
        core = self.core
        if core.abort_reason is not None:
            return core.abort_reason
        if conn.generation != core.generation or conn.superseded:
            return f"generation {conn.generation} was superseded by generation {core.generation}"
        if self.ledger.failures:
            ranks, parts = self.ledger.describe_locked()
            return f"rank(s) {ranks} failed, so {stopped or self._what_a_failure_stops()} cannot complete ({parts})"
        return None

    def _what_a_failure_stops(self) -> str:
        return f"the {self.mode} run"

    def _refuse_if_unservable_locked(self, conn: RankConnection) -> None:
        refusal = self.refusal_locked(conn)
        if refusal is not None:
            raise Refusal(refusal)

    def _nonfinite(self, conn: RankConnection, step: int) -> Refusal:
        return Refusal(f"rank {conn.rank} pushed a gradient with NaN/Inf for step {step}; "
                       "lower train.lr or check the loss", kind=NONFINITE)

    def push(self, conn: RankConnection, step: int, grad: Contribution) -> int:
        """Take the push; returns the step its ACK carries."""
        raise NotImplementedError

    def pull(self, conn: RankConnection, wanted: int) -> int:
        """Wait until ``wanted`` may be served; returns the version, with a reader registered for it."""
        raise NotImplementedError

    def _await_version(self, conn: RankConnection, wanted: int) -> int:
        """The wait of a PULL for version ``wanted`` (sync, average, async): until the version reached it
        with no update in flight, refused as soon as the request cannot be served
        (:meth:`_unreachable_locked`) or the step deadline passes. Returns the version, with a reader
        registered for it."""
        core = self.core
        deadline = deadline_after(self.timeout)
        with core.cond:
            while True:
                self._refuse_if_unservable_locked(conn)
                if core.version >= wanted and not core.stepping:
                    return core.begin_read_locked(conn)
                self._unreachable_locked(conn, wanted)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refusal(self._version_timeout_text_locked(wanted), kind=TIMEOUT)
                core.cond.wait(left)

    def _unreachable_locked(self, conn: RankConnection, wanted: int) -> None:
        """Raise Refusal if version ``wanted`` can never be reached for ``conn`` (the wait would only time out)."""

    def _version_timeout_text_locked(self, wanted: int) -> str:
        return self.timeout.message(f"version {wanted} (at {self.core.version})")

    def push_pull(self, conn: RankConnection, step: int, grad: Contribution) -> int:
        """PUSH(step) then PULL(step + 1) as one request: one round trip per step instead of two."""
        self.push(conn, step, grad)
        return self.pull(conn, step + 1)


class SyncPolicy(ConsistencyPolicy):
    """BSP: a step is applied once every rank pushed it (see module docstring)."""

    mode = "sync"
    sums_in_place = True

    def __init__(self, core: ShardCore, roster: Roster, ledger: FailureLedger, stats: ShardStats,
                 consistency: Consistency) -> None:
        super().__init__(core, roster, ledger, stats, consistency)
        self.pushed: set[int] = set()  # ranks that pushed step == version
        # The rank whose push, read in place, left a NaN/Inf in a sum other ranks' pushes were already in:
        # that sum can no longer be applied, nor repaired, until the next generation starts the step anew.
        self.poisoned_by: int | None = None

    def pending_locked(self) -> int:
        return len(self.pushed)

    def new_generation_locked(self) -> int:
        discarded = len(self.pushed)
        self.pushed.clear()
        self.poisoned_by = None
        super().new_generation_locked()
        return discarded

    def _what_a_failure_stops(self) -> str:
        return f"synchronous step {self.core.version}"

    def _apply(self, grad_sum: torch.Tensor) -> None:
        self.core.optimizer_step(grad_sum, self.world_size)

    def push(self, conn: RankConnection, step: int, grad: Contribution) -> int:
        # Outside the lock, a full pass over the gradient; one read in place is checked in the sum instead.
        finite = True if grad.in_place else grad.all_finite()
        core = self.core
        with core.cond:
            self._refuse_if_unservable_locked(conn)
            if step != core.version:
                raise Refusal(f"rank {conn.rank} pushed a gradient for step {step} but the server is at "
                              f"version {core.version}; synchronous mode expects step == version")
            if conn.rank in self.pushed:
                raise Refusal(f"rank {conn.rank} already pushed a gradient for step {step}")
            if not finite:
                raise self._nonfinite(conn, step)
            if self.poisoned_by is not None:
                raise Refusal(f"the gradient sum of step {step} holds rank {self.poisoned_by}'s NaN/Inf push, so "
                              "the step cannot complete; lower train.lr or check the loss", kind=NONFINITE)
            timing = self.stats.timing
            started = timing.now()
            if self.pushed:
                grad.add_to(core.grad_sum)
            else:  # first push of the step: one pass that overwrites the (stale) sum
                grad.start_sum(core.grad_sum)
                timing.first_push_at = started
            # The sum is this shard's own memory, which the pushing rank cannot change after this check.
            if grad.in_place and not all_finite(core.grad_sum):
                if self.pushed:
                    self.poisoned_by = conn.rank
                raise self._nonfinite(conn, step)
            timing.reduced_locked(started)
            self.pushed.add(conn.rank)
            self.stats.pushed_locked(conn.rank, step)
            if len(self.pushed) == self.world_size:
                timing.sync_wait_s += started - timing.first_push_at
            # The sum is not zeroed after the step: the next step's first push overwrites it.
            if len(self.pushed) == self.world_size and core.update_locked(self._timed_apply):
                self.stats.applied_locked(self.pushed)
                self.pushed.clear()
            core.cond.notify_all()
        return step

    def _timed_apply(self) -> None:
        started = self.stats.timing.now()
        self._apply(self.core.grad_sum)
        self.stats.timing.applied_locked(started)

    def pull(self, conn: RankConnection, wanted: int) -> int:
        return self._await_version(conn, wanted)

    def _unreachable_locked(self, conn: RankConnection, wanted: int) -> None:
        core = self.core
        # While stepping the version is about to move: wait for it.
        if not core.stepping and (wanted > core.version + 1 or conn.rank not in self.pushed):
            raise Refusal(
                f"rank {conn.rank} asked for version {wanted} but the server is at version "
                f"{core.version} and rank {conn.rank} has not pushed step {core.version}; "
                "in synchronous mode a rank may only wait for the step it has pushed")
        gone = sorted(r for r in self.roster.finished if r not in self.pushed)
        if gone:
            raise Refusal(f"rank(s) {', '.join(map(str, gone))} finished without pushing step "
                          f"{core.version}, so version {wanted} can never be reached")

    def _version_timeout_text_locked(self, wanted: int) -> str:
        missing = sorted(set(range(self.world_size)) - self.pushed)
        never = self.roster.never_connected_locked(missing)
        what = (f"version {wanted}: rank(s) {', '.join(map(str, missing))} had not pushed step "
                f"{self.core.version}")
        if never:
            what += f" (rank(s) {', '.join(map(str, never))} never connected)"
        return self.timeout.message(what) + " if these workers are only slow"


class AveragePolicy(SyncPolicy):
    """Local SGD: the BSP path, where a complete round adds the replicas' mean parameter delta."""

    mode = "average"

    def _apply(self, grad_sum: torch.Tensor) -> None:
        self.core.add_mean_delta(grad_sum, self.world_size)


class _ClockPolicy(ConsistencyPolicy):
    """ssp/async: each rank pushes its own steps in order, each at most once."""

    def _check_clock_locked(self, conn: RankConnection, step: int, finite: bool) -> None:
        expected = self.clock.get(conn.rank, 0)
        if step != expected:
            raise Refusal(f"rank {conn.rank} pushed step {step} but its next step is {expected}; in "
                          f"{self.mode} mode each rank pushes its steps once, in order")
        if not finite:
            raise self._nonfinite(conn, step)


class SspPolicy(_ClockPolicy):
    """Stale-synchronous: whole clocks applied in order, a rank at most ``staleness`` clocks ahead."""

    mode = "ssp"

    def __init__(self, core: ShardCore, roster: Roster, ledger: FailureLedger, stats: ShardStats,
                 consistency: Consistency) -> None:
        super().__init__(core, roster, ledger, stats, consistency)
        self.bound = consistency.staleness
        # One gradient sum per clock that may be in flight (slot 0 is the core's sum).
        self.ring = [core.grad_sum] + [torch.zeros_like(core.grad_sum) for _ in range(self.bound)]
        self.clock_pushed: dict[int, set[int]] = {}  # clock -> ranks that pushed it
        self.waiting: dict[int, int] = {}  # rank -> clock it is blocked on (observability)

    def clock_on_connect_locked(self, rank: int) -> int:
        # Every clock before the version is applied, so a (re)connecting rank starts at the version.
        return self.clock.setdefault(rank, self.core.version)

    def pending_locked(self) -> int:
        return sum(len(ranks) for ranks in self.clock_pushed.values())

    def new_generation_locked(self) -> int:
        discarded = self.pending_locked()
        self.clock_pushed.clear()
        super().new_generation_locked()
        for buf in self.ring:
            buf.zero_()
        return discarded

    def waiting_locked(self) -> dict[int, int]:
        return dict(self.waiting)

    def push(self, conn: RankConnection, step: int, grad: Contribution) -> int:
        """Add to the clock's sum; apply every clock that is now complete, in order."""
        finite = grad.all_finite()
        core, bound = self.core, self.bound
        with core.cond:
            self._refuse_if_unservable_locked(conn)
            self._check_clock_locked(conn, step, finite)
            if step - core.version > bound:
                raise Refusal(f"rank {conn.rank} pushed clock {step} while the slowest rank is at clock "
                              f"{core.version}: more than ps.staleness={bound} ahead (PULL first)")
            core.wait_not_stepping_locked(f"adding clock {step} of rank {conn.rank}")
            # Clock `step` is applied at version `step`: the gradient is that many versions past its pull.
            stale = step - conn.pulled_version
            timing = self.stats.timing
            started = timing.now()
            grad.add_to(self.ring[step % (bound + 1)], alpha=weight(self.consistency.staleness_scale, stale))
            timing.reduced_locked(started)
            self.stats.staleness_locked(stale)
            self.clock_pushed.setdefault(step, set()).add(conn.rank)
            self.clock[conn.rank] = step + 1
            self.stats.pushed_locked(conn.rank, step)
            while len(self.clock_pushed.get(core.version, ())) == self.world_size:
                clock = core.version
                if not core.update_locked(lambda buf=self.ring[clock % (bound + 1)]: self._apply(buf)):
                    break
                del self.clock_pushed[clock]
            core.cond.notify_all()
        return step

    def _apply(self, clock_sum: torch.Tensor) -> None:
        started = self.stats.timing.now()
        self.core.optimizer_step(clock_sum, self.world_size)
        clock_sum.zero_()
        self.stats.timing.applied_locked(started)

    def pull(self, conn: RankConnection, wanted: int) -> int:
        """PULL(c) = "rank wants to start clock c": wait until c - slowest <= staleness."""
        core, bound = self.core, self.bound
        started = time.monotonic()
        deadline = started + self.timeout.seconds
        blocked = False
        with core.cond:
            try:
                while True:
                    self._refuse_if_unservable_locked(conn)
                    if self.clock.get(conn.rank, 0) < wanted:
                        raise Refusal(f"rank {conn.rank} asked to start clock {wanted} but has pushed only "
                                      f"{self.clock.get(conn.rank, 0)} clocks; push before pulling")
                    if wanted - core.version <= bound and not core.stepping:
                        break
                    if not core.stepping:
                        gone = sorted(r for r in self.roster.finished if self.clock.get(r, 0) < wanted - bound)
                        if gone:
                            raise Refusal(f"rank(s) {', '.join(map(str, gone))} finished behind clock "
                                          f"{wanted - bound}, so rank {conn.rank} can never start clock {wanted}")
                        blocked = True
                        self.waiting[conn.rank] = wanted
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Refusal(self._timeout_text_locked(conn.rank, wanted), kind=TIMEOUT)
                    core.cond.wait(left)
            finally:
                self.waiting.pop(conn.rank, None)
                if blocked:
                    self.stats.blocked_pull_locked(conn.rank, time.monotonic() - started)
            return core.begin_read_locked(conn)

    def _timeout_text_locked(self, rank: int, wanted: int) -> str:
        version = self.core.version
        slow = sorted(r for r in range(self.world_size) if self.clock.get(r, 0) <= version)
        what = (f"the slowest rank(s) {', '.join(map(str, slow))} (at clock {version}) so that rank {rank} "
                f"may start clock {wanted} within ps.staleness={self.bound}")
        return self.timeout.message(what) + " if these workers are only slow"


class AsyncPolicy(_ClockPolicy):
    """Every push is applied on arrival as one optimizer step; the ACK carries the version it was
    applied to, so the worker knows its staleness."""

    mode = "async"

    def new_generation_locked(self) -> int:
        # Pushes were applied one by one, so each rank resumes at its own clock (its data position).
        self.core.grad_sum.zero_()
        return 0

    def checkpoint_clocks_locked(self) -> dict[int, int]:
        return dict(self.clock)  # each rank's next step: where its data resumes

    def restore_clocks_locked(self, clocks: dict[int, int]) -> None:
        self.clock = {int(r): int(c) for r, c in clocks.items()}

    def push(self, conn: RankConnection, step: int, grad: Contribution) -> int:
        finite = grad.all_finite()
        core = self.core
        with core.cond:
            self._refuse_if_unservable_locked(conn)
            self._check_clock_locked(conn, step, finite)
            core.wait_not_stepping_locked(f"applying step {step} of rank {conn.rank}")
            base = core.version
            started = self.stats.timing.now()
            core.grad_sum.zero_()
            grad.add_to(core.grad_sum)
            self.stats.timing.reduced_locked(started)
            scale = weight(self.consistency.staleness_scale, base - conn.pulled_version)
            if not core.update_locked(lambda: self._apply(scale)):
                raise Refusal(f"generation {conn.generation} was superseded by generation {core.generation}")
            self.clock[conn.rank] = step + 1
            self.stats.pushed_locked(conn.rank, step)
            self.stats.applied_locked([conn.rank])
            self.stats.staleness_locked(base - conn.pulled_version)
        return base

    def _apply(self, scale: float) -> None:
        started = self.stats.timing.now()
        scaled_step(self.core, self.core.grad_sum, 1, scale)
        self.core.grad_sum.zero_()
        self.stats.timing.applied_locked(started)

    def pull(self, conn: RankConnection, wanted: int) -> int:
        """PULL(v) waits until version >= v (workers ask for 0: it never blocks)."""
        return self._await_version(conn, wanted)

    def push_pull(self, conn: RankConnection, step: int, grad: Contribution) -> int:
        raise Refusal("PUSH_PULL is not available in async mode (the push's ACK carries the version it "
                      "was applied to); send PUSH then PULL")


POLICIES: dict[str, type[ConsistencyPolicy]] = {"sync": SyncPolicy, "ssp": SspPolicy, "async": AsyncPolicy,
                                                "average": AveragePolicy}


def make_policy(core: ShardCore, roster: Roster, ledger: FailureLedger, stats: ShardStats,
                consistency: Consistency) -> ConsistencyPolicy:
    # Consistency validated the mode, so every mode it admits has a policy here.
    return POLICIES[consistency.mode](core, roster, ledger, stats, consistency)
