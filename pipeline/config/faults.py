"""``faults``: fault injection for tests and drills (every key off by default), validated at construction."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from pipeline.config.section import Section


class FaultsConfig(Section):
    """Fault injection for tests and drills; everything off by default."""

    # Rank that raises InjectedFault once it reaches fail_step.
    fail_rank: Optional[int] = Field(None, ge=0)
    fail_step: int = Field(0, ge=0)  # the step at which fail_rank raises
    # train.backend=allreduce: fail_rank fails while joining the process group instead of at fail_step.
    fail_in_rendezvous: bool = False
    # Rank whose Python worker process SIGKILLs itself at kill_step (a crash with no goodbye).
    kill_rank: Optional[int] = Field(None, ge=0)
    kill_step: int = Field(0, ge=0)  # the step at which kill_rank is SIGKILLed
    # Rank that sleeps delay_ms before every step from delay_step on (a straggler, or a hung worker
    # when delay_ms exceeds ps.timeout_s).
    delay_rank: Optional[int] = Field(None, ge=0)
    delay_ms: float = Field(0.0, ge=0)  # how long delay_rank sleeps per step
    delay_step: int = Field(0, ge=0)  # the first step delay_rank sleeps at
    # Rank whose loss is multiplied by explode_factor at explode_step (the divergence guard's drill).
    explode_rank: Optional[int] = Field(None, ge=0)
    explode_step: int = Field(0, ge=0)  # the step from which explode_rank multiplies its loss
    explode_factor: float = Field(1e6, gt=0)  # explode_rank's loss multiplier
    # Faults fire in the first `attempts` barrier attempts only, so a driver retry can succeed.
    attempts: int = Field(1, ge=1)
    # Test/drill hook: every rank appends each applied step's (epoch, step, row digests) to a JSON-lines file
    # in this folder (exactly-once checks across retries and resumes); null: off. Active in every attempt.
    record_rows_dir: Optional[str] = Field(None, min_length=1)
