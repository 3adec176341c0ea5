"""The per-step timing breakdown of ``train.profile``: where a worker's step time goes, per epoch.

Why a lap timer (one clock read per phase boundary, each lap charged to the phase that just ended)
instead of start/stop pairs: consecutive phases share their boundary reading, so nothing between two
phases goes unaccounted and nothing is counted twice; what is left of the epoch's wall time
(``other_ms``: the loop's own Python, the epoch tail) is measured against the loop's existing epoch
clock, independently of the laps. Why a null timer when off: the hot loop calls the same methods either
way, and the null one reads no clock (a no-op call costs well under a microsecond; see the test).

Reported per epoch as ``time/<phase>_ms`` (mean milliseconds per step) plus ``time/step_ms`` and
``time/other_ms``; the driver averages them over ranks (``summarize``) into the epoch row MLflow logs.
"""
from __future__ import annotations

import time

# In step order. grad_flatten: unscale + copy of the gradients into the flat push buffer; push: the
# gradient frames out (compression included); pull_wait: waiting for the server's answer (the slowest
# rank, the reduce, the optimizer) and receiving the parameters; load_params: parameters into the model;
# exchange_other: the rest of the exchange (a local optimizer step: ps.mode=average, allreduce).
# ps.overlap: buckets sent while backward runs are backward's time; push is then the buckets left after it,
# and with flat views (pipeline.worker.buckets) grad_flatten and load_params are ~0 (no copies left).
PHASES = ("data_wait", "to_device", "forward", "backward", "grad_flatten", "push", "pull_wait", "load_params",
          "exchange_other", "metrics_logs")
PREFIX = "time/"


class StepTimer:
    """Accumulates the laps of one epoch; ``take`` returns the per-step means and starts the next."""

    enabled = True

    def __init__(self, sync=None) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._sync = sync
        self._last = time.perf_counter()

    def start(self) -> None:
        """The epoch's first lap starts now (waiting for its first batch is data_wait)."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self._sums[phase] += now - self._last
        self._last = now

    def take(self, seconds: float, steps: int) -> dict[str, float]:
        """Mean ms per step of each phase over ``steps`` steps of an epoch that took ``seconds``."""
        steps = max(steps, 1)
        out = {f"{PREFIX}{phase}_ms": 1000.0 * total / steps for phase, total in self._sums.items()}
        step_ms = 1000.0 * seconds / steps
        out[f"{PREFIX}step_ms"] = step_ms
        out[f"{PREFIX}other_ms"] = step_ms - sum(1000.0 * total / steps for total in self._sums.values())
        self._sums = dict.fromkeys(PHASES, 0.0)
        return out


class NullTimer:
    """``train.profile: false``: the same calls, no clock reads, no keys."""

    enabled = False

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def take(self, seconds: float, steps: int) -> dict[str, float]:
        return {}


def step_timer(profile: bool, device: str = "cpu") -> StepTimer | NullTimer:
    """On a CUDA device each lap first waits for the queued kernels (profiling only): kernels run
    asynchronously, so without it a phase's GPU time would land in whichever later phase syncs
    (the loss's ``.item()`` in backward). The syncs slow a profiled step a little; the shares are honest."""
    if not profile:
        return NullTimer()
    if str(device).startswith("cuda"):
        import torch

        return StepTimer(sync=torch.cuda.synchronize)
    return StepTimer()


def timing_keys(metrics: dict) -> list[str]:
    return [key for key in metrics if key.startswith(PREFIX)]


def summarize(reports: dict[int, dict]) -> dict[str, float]:
    """The epoch row's breakdown: each ``time/*`` key averaged over the ranks that report it (all of
    them, or none when profiling is off), plus the slowest rank's step as ``time/step_ms_max`` and the
    least and most any rank waited for the exchange, ``time/pull_wait_ms_min`` / ``_max``: ranks that
    hold the others up wait least, so a wide spread names an imbalance the mean hides (rank 0 alone
    evaluating the validation split made one rank wait 6.4 ms per step, the other 3.2)."""
    rows = list(reports.values())
    keys = [key for key in timing_keys(rows[0]) if all(key in r for r in rows)] if rows else []
    out = {key: sum(float(r[key]) for r in rows) / len(rows) for key in keys}
    if f"{PREFIX}step_ms" in out:
        out[f"{PREFIX}step_ms_max"] = max(float(r[f"{PREFIX}step_ms"]) for r in rows)
    if f"{PREFIX}pull_wait_ms" in out:
        waits = [float(r[f"{PREFIX}pull_wait_ms"]) for r in rows]
        out[f"{PREFIX}pull_wait_ms_min"], out[f"{PREFIX}pull_wait_ms_max"] = min(waits), max(waits)
    return out


def table(row: dict) -> str:
    """One epoch row's breakdown as an aligned text table (ms per step and share of the step)."""
    step = float(row.get(f"{PREFIX}step_ms", 0.0)) or 1e-12
    lines = [f"{'phase':<15}{'ms/step':>10}{'share':>8}"]
    for phase in (*PHASES, "other"):
        value = float(row.get(f"{PREFIX}{phase}_ms", 0.0))
        lines.append(f"{phase:<15}{value:>10.3f}{100.0 * value / step:>7.1f}%")
    lines.append(f"{'step':<15}{step:>10.3f}{100.0:>7.1f}%")
    return "\n".join(lines)
