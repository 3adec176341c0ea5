"""Several servers that together serve one model, driven as one: the K shards of a ``ParameterServer``
(each a slice, every rank talks to all of them) and the P stage servers of a ``StagedParameterServer``
(each a stage, a rank talks to its own stage's server).

Why one helper: both facades must start all members or none, close and abort all, move every member to
the same generation, and report one version, one set of ranks and one failure account. What differs
is only how member-local ranks map to the facade's ranks (``rank_of``): shards share the facade's ranks,
stages own disjoint ones.

Why a new generation is refused at different versions: a step is applied per member, not atomically
across members; if a rank died between its pushes to two of them, their versions end one step apart,
and continuing would train on mixed parameters.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from pipeline.errors import PSError, WorkerFailure

logger = logging.getLogger(__name__)

_SNAPSHOT_POLL_S = 0.002


class Member(Protocol):
    """What the group needs of each server it drives (``ShardServer`` or ``ParameterServer``)."""

    def start(self) -> Any: ...
    def close(self) -> None: ...
    def fail(self, reason: str) -> None: ...
    def new_generation(self, generation: int | None = None) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def aborted(self) -> bool: ...
    @property
    def registered_ranks(self) -> set[int]: ...
    @property
    def finished_ranks(self) -> set[int]: ...
    @property
    def failures(self) -> dict[int, WorkerFailure]: ...


M = TypeVar("M", bound=Member)


@dataclasses.dataclass(frozen=True)
class MixedVersionsText:
    """How a refusal at different versions reads: ``{name} are at different versions [..]: a step was
    applied on some {unit} only{cause}; {fix}``."""

    unit: str
    cause: str
    fix: str


class ServerGroup(Generic[M]):
    """Lifecycle and aggregate views over ``members`` (see module docstring). ``rank_of(i, r)`` is the
    facade's rank of member ``i``'s rank ``r``; None: every member serves the facade's own ranks."""

    def __init__(self, members: Sequence[M], *, name: str, mixed: MixedVersionsText,
                 rank_of: Callable[[int, int], int] | None = None) -> None:
        self.members = list(members)
        self._name = name
        self._mixed = mixed
        self._rank_of = rank_of

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every member in order; if one fails, close those already started and re-raise."""
        started: list[M] = []
        try:
            for member in self.members:
                member.start()
                started.append(member)
        except BaseException:
            for member in started:
                member.close()
            raise

    def close(self) -> None:
        for member in self.members:
            member.close()

    def fail(self, reason: str) -> None:
        for member in self.members:
            member.fail(reason)

    def new_generation(self, generation: int | None, *, refuse_mixed_versions: bool) -> int:
        """Move every member to one new generation (the first member picks it when None)."""
        versions = [m.version for m in self.members]
        if refuse_mixed_versions and len(set(versions)) > 1:
            raise PSError(f"{self._name} are at different versions {versions}: a step was applied on some "
                          f"{self._mixed.unit} only{self._mixed.cause}; {self._mixed.fix}")
        new = self.members[0].new_generation(generation)
        for member in self.members[1:]:
            member.new_generation(new)
        return new

    # -- aggregate views ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version every member has reached."""
        return min(m.version for m in self.members)

    @property
    def generation(self) -> int:
        return self.members[0].generation

    @property
    def aborted(self) -> bool:
        return any(m.aborted for m in self.members)

    def _ranks(self, index: int, ranks: set[int]) -> set[int]:
        return ranks if self._rank_of is None else {self._rank_of(index, r) for r in ranks}

    @property
    def registered_ranks(self) -> set[int]:
        """Ranks that authenticated with any member in this generation."""
        return set().union(*(self._ranks(i, m.registered_ranks) for i, m in enumerate(self.members)))

    @property
    def silences(self) -> dict[int, tuple[float, str]]:
        """{rank: (seconds since it was last heard, host)}: a rank any member heard recently is not silent.
        Members that cannot tell (shard processes behind a proxy) add nothing."""
        out: dict[int, tuple[float, str]] = {}
        for index, member in enumerate(self.members):
            for local, (silent, host) in (getattr(member, "silences", None) or {}).items():
                rank = self._ranks(index, {local}).pop()
                if rank not in out or silent < out[rank][0]:
                    out[rank] = (silent, host or out.get(rank, (0.0, ""))[1])
        return out

    @property
    def finished_ranks(self) -> set[int]:
        """Ranks that finished with every member that serves them."""
        per = [self._ranks(i, m.finished_ranks) for i, m in enumerate(self.members)]
        return set.intersection(*per) if self._rank_of is None else set().union(*per)

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        if self._rank_of is None:
            # Members that share ranks mirror every failure (failures.FailureBoard), in one order.
            return self.members[0].failures
        out: dict[int, WorkerFailure] = {}
        for index, member in enumerate(self.members):
            for local, failure in member.failures.items():
                rank = self._rank_of(index, local)
                out[rank] = dataclasses.replace(failure, rank=rank)
        return out

    def summed_stats(self, per: list[dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
        """The first member's stats (its counters of logical events) with ``keys`` summed over all."""
        merged = dict(per[0])
        for key in keys:
            merged[key] = sum(p.get(key, 0) for p in per)
        return merged

    # -- checkpoints -------------------------------------------------------------------------------
    def consistent_states(self, take: Callable[[M], dict[str, Any]], timeout_s: float, *,
                          must_agree: bool) -> list[dict[str, Any]]:
        """Every member's state, retaken until all are at one version (when ``must_agree``): members
        apply a step at different moments, and a step half-applied across them is no state any run had."""
        deadline = time.monotonic() + timeout_s
        # All members at once: taken one after another, shards in other processes or on other hosts (a
        # round trip each) would straddle a step far more often than they land between two.
        with ThreadPoolExecutor(max_workers=len(self.members), thread_name_prefix="ps-snapshot") as pool:
            while True:
                states = list(pool.map(take, self.members))
                versions = sorted({st["version"] for st in states})
                if len(versions) == 1 or not must_agree:
                    return states
                if time.monotonic() > deadline:
                    raise PSError(f"could not take a consistent snapshot: {self._name} stayed at versions "
                                  f"{versions} for {timeout_s:g}s")
                time.sleep(_SNAPSHOT_POLL_S)
