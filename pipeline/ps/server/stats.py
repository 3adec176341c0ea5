"""Counters of one shard, and the ``stats`` dict the driver, benchmarks and tests read.

Guarded by the shard's condition like the state they count, so a report is one consistent moment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.ps.server.timing import ServerTiming


@dataclass
class ShardStats:
    bytes_received: int = 0  # of closed connections; live ones are added at report time
    bytes_sent: int = 0
    pushes_applied: int = 0
    # (rank, step) contributions actually applied, per rank: a step cut by new_generation() before every
    # rank pushed is discarded and redone by the next attempt, so it is counted there, once.
    steps_applied_by_rank: dict[int, int] = field(default_factory=dict)
    discarded_pushes: int = 0  # pushes of steps that a new generation cut before they were complete
    generations: int = 1
    rejected_connections: int = 0
    protocol_errors: int = 0
    last_step_by_rank: dict[int, int] = field(default_factory=dict)
    push_payload_bytes: int = 0  # tensor bytes of PUSH frames: what compression shrinks
    # async: versions applied between a rank's pull and its push being applied; ssp: clock minus the version pulled
    staleness_max: int = 0
    staleness_sum: int = 0
    staleness_count: int = 0
    blocked_pulls: int = 0  # ssp: pulls that had to wait for the slowest rank
    pull_wait_s_by_rank: dict[int, float] = field(default_factory=dict)  # ssp: time blocked per rank
    timing: ServerTiming = field(default_factory=ServerTiming)  # reduce / optimizer / slowest-rank wait

    def pushed_locked(self, rank: int, step: int) -> None:
        self.pushes_applied += 1
        self.last_step_by_rank[rank] = step

    def applied_locked(self, ranks: list[int] | set[int]) -> None:
        for rank in ranks:
            self.steps_applied_by_rank[rank] = self.steps_applied_by_rank.get(rank, 0) + 1

    def staleness_locked(self, staleness: int) -> None:
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_sum += staleness
        self.staleness_count += 1

    def blocked_pull_locked(self, rank: int, seconds: float) -> None:
        self.blocked_pulls += 1
        self.pull_wait_s_by_rank[rank] = self.pull_wait_s_by_rank.get(rank, 0.0) + seconds

    def report_locked(self, *, live_bytes: tuple[int, int], requests_in_flight: int, mode: str,
                      compression: str, clock_by_rank: dict[int, int]) -> dict[str, Any]:
        """The public ``stats`` dict; ``live_bytes`` = (received, sent) of the connections still open."""
        received, sent = live_bytes
        return {
            "bytes_received": self.bytes_received + received,
            "bytes_sent": self.bytes_sent + sent,
            "pushes_applied": self.pushes_applied,
            "steps_applied_by_rank": dict(self.steps_applied_by_rank),
            "discarded_pushes": self.discarded_pushes,
            "generations": self.generations,
            "rejected_connections": self.rejected_connections,
            "protocol_errors": self.protocol_errors,
            "last_step_by_rank": dict(self.last_step_by_rank),
            "requests_in_flight": requests_in_flight,  # PULL/PUSH being handled or waiting now
            "mode": mode,
            "compression": compression,
            "push_payload_bytes": self.push_payload_bytes,
            "staleness_max": self.staleness_max,
            "staleness_mean": self.staleness_sum / self.staleness_count if self.staleness_count else 0.0,
            "blocked_pulls": self.blocked_pulls,
            "pull_wait_s_by_rank": dict(self.pull_wait_s_by_rank),
            "clock_by_rank": dict(clock_by_rank),
            **self.timing.report(),
        }
