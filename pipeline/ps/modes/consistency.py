"""Consistency modes (``ps.mode``): their names, parameters, and what each means for step counting.

Why one wire protocol serves all four: a PUSH always carries ``step`` and a tensor, a PULL always
carries a number the rank waits for; only the server's interpretation changes:

* ``sync`` (BSP): PUSH step == server version; PULL(t+1) waits until all ranks pushed t and the
  averaged gradient was applied. Version counts optimizer steps.
* ``ssp``: PUSH step == the rank's clock (its own step count); gradients of clock t are summed and
  applied, averaged, once every rank pushed clock t (clocks applied in order), so ``staleness: 0`` is
  exactly ``sync``. PULL(c) (the rank wants to start clock c) waits until ``c - slowest <= staleness``.
  SSP only guarantees that updates older than ``staleness`` clocks are visible; aggregating whole
  clocks keeps the optimizer math identical to sync and the result independent of arrival order.
* ``async``: every PUSH is applied on arrival as one optimizer step (Downpour/Hogwild style); PULL(0)
  never waits. Version counts applied pushes; the ACK carries the version the gradient was applied
  to, so the worker knows its staleness (that version minus the one it computed on).
* ``average`` (local SGD): workers step a local optimizer and every ``sync_every`` steps (and after
  the last) push ``local - last_average``; the server adds the mean delta, which is the average of the
  replicas because all started from the same average. Version counts averaging rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.errors import PSError
from pipeline.ps.modes.staleness import check_scale

MODES = ("sync", "async", "ssp", "average")
MODE_KEY = "ps.mode"


@dataclass(frozen=True)
class Consistency:
    """The consistency settings the server and the workers must agree on."""

    mode: str = "sync"
    staleness: int = 0  # ssp only
    sync_every: int = 1  # average only
    # async/ssp: how a gradient is weighted by its staleness (``pipeline.ps.modes.staleness``); server-side only,
    # so not announced in WELCOME. "none" here; the config's ps.staleness_scale defaults to "inverse".
    staleness_scale: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PSError(f"{MODE_KEY}: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.staleness < 0:
            raise PSError(f"ps.staleness must be >= 0, got {self.staleness}")
        if self.sync_every < 1:
            raise PSError(f"ps.sync_every must be >= 1, got {self.sync_every}")
        check_scale(self.staleness_scale)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "staleness": self.staleness, "sync_every": self.sync_every}


def averaging_rounds(total_steps: int, sync_every: int) -> int:
    """Rounds of ``average`` mode: one every ``sync_every`` local steps, plus one after the last."""
    return math.ceil(total_steps / sync_every) if total_steps > 0 else 0


def is_sync_point(local_step: int, total_steps: int, sync_every: int) -> bool:
    """Whether ``average`` mode pushes after local step ``local_step`` (1-based)."""
    return local_step % sync_every == 0 or local_step == total_steps


def expected_version(consistency: Consistency, total_steps: int, world_size: int) -> int:
    """The server version after every rank ran ``total_steps`` steps (what launch checks)."""
    if consistency.mode == "async":
        return total_steps * world_size
    if consistency.mode == "average":
        return averaging_rounds(total_steps, consistency.sync_every)
    return total_steps


def resume_step(consistency: Consistency, state: dict, rank: int, total_steps: int) -> int:
    """The step ``rank`` starts at on a server loaded from ``state`` (what its exchange's start() returns):
    the version in sync/ssp, its own clock in async, the last merged round's local step in average."""
    if consistency.mode == "async":
        return int(dict(state.get("clocks") or {}).get(rank, 0))
    if consistency.mode == "average":
        return min(int(state["version"]) * consistency.sync_every, total_steps)
    return int(state["version"])
