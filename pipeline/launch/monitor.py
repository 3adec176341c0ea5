"""Driver side, beside the PS: early stopping on a validation metric and the divergence guard.

Both watch the epoch rows the driver assembles from the ranks' reports (``EpochProgress``), keep the
state of the best epoch so far (the PS's state at that epoch's end, in memory) and, to stop, abort the
parameter server: every rank's next PS call fails, the attempt ends, and the placement asks
``accounts_for`` before the retry policy, so a stop the monitor caused is not a failure. The run's model
is then the best epoch's, and ``stop`` says why and which epoch (the MLflow tags).

A non-finite loss raises NonFiniteError on its rank (``worker.guards``) and fails the attempt; with the
guard on, that failure is accounted for here the same way: training stops and the best epoch is kept
(when there is one: a divergence before the first epoch ends has nothing to restore and fails the run).

Why the PS's state at the epoch's report: in sync mode (and ssp/average, lockstep) the server cannot
apply the next step before the last rank reporting the epoch pushes it, so the state is exactly the
epoch's end; in async it is the state when the last report arrived.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from pipeline.errors import WorkerTrainingFailedError

log = logging.getLogger(__name__)

EARLY_STOP = "early_stop"
DIVERGED = "diverged"


@dataclass(frozen=True)
class StopInfo:
    """Why training ended before its last epoch, or with another epoch's model than the last."""

    kind: str  # early_stop | diverged | best_epoch (completed, the best epoch restored)
    reason: str
    best_epoch: Optional[int]  # 0-based
    best_step: Optional[int]
    best_value: Optional[float]
    metric: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tags(self) -> dict[str, str]:
        """MLflow tags of the run (1-based epoch, as the progress lines print it)."""
        tags = {"shardline.stopped": self.kind, "shardline.stop_reason": self.reason[:5000],
                "shardline.best_metric": self.metric}
        if self.best_epoch is not None:
            tags["shardline.best_epoch"] = str(self.best_epoch + 1)
            tags["shardline.best_step"] = str(self.best_step)
            tags["shardline.best_value"] = f"{self.best_value:.6g}"
        if self.kind == DIVERGED:
            tags["shardline.diverged"] = "true"
        return tags


class TrainingMonitor:
    """Early stopping (``train.early_stopping``) and the divergence guard (``train.divergence``).

    ``snapshot()`` returns the state to keep for the best epoch (it must hold ``"step"`` and the PS state
    under ``"ps"``); ``abort(reason)`` stops the workers (the PS's ``fail``)."""

    def __init__(self, early, divergence, epochs: int, *, snapshot: Callable[[], dict],
                 abort: Callable[[str], None], guard: Optional[bool] = None) -> None:
        self.early = early
        self.divergence = divergence
        # Whether the divergence guard is on (config.train_options.divergence_on); None: divergence.enabled.
        self.guard = bool(divergence.enabled) if guard is None else guard
        self.epochs = epochs
        self.metric = early.metric
        direction = early.direction or ("max" if "accuracy" in early.metric else "min")
        self._better = (lambda a, b: a > b + early.min_delta) if direction == "max" else \
            (lambda a, b: a < b - early.min_delta)
        self._snapshot, self._abort = snapshot, abort
        self._lock = threading.Lock()
        self.best: Optional[dict] = None
        self.best_epoch: Optional[int] = None
        self.best_value: Optional[float] = None
        self.lowest_train_loss = math.inf
        self.first_train_loss: Optional[float] = None
        self.stale_epochs = 0
        self.stop: Optional[StopInfo] = None
        self._warned_metric = False

    # -- epochs ------------------------------------------------------------------------------------
    def on_epoch(self, row: dict) -> None:
        """One epoch row (called from a PS connection thread as the epoch completes)."""
        with self._lock:
            if self.stop is not None:
                return
            epoch, loss = int(row["epoch"]), float(row.get("train_loss", math.nan))
            if self.guard and self._diverged(loss):
                why = (f"epoch {epoch + 1}: train loss {loss:.6g} is not finite" if not math.isfinite(loss) else
                       f"epoch {epoch + 1}: train loss {loss:.6g} is over train.divergence.factor="
                       f"{self.divergence.factor:g} x the best epoch's {self.lowest_train_loss:.6g} and over "
                       f"the first epoch's {self.first_train_loss:.6g}")
                self._stop(DIVERGED, why, epoch)
                return
            self.lowest_train_loss = min(self.lowest_train_loss, loss)
            if self.first_train_loss is None:
                self.first_train_loss = loss
            value = self._value(row)
            if value is not None and (self.best_value is None or self._better(value, self.best_value)):
                try:
                    best = self._snapshot()
                except Exception as exc:  # noqa: BLE001 - the server failed meanwhile: the attempt fails anyway
                    # The epoch row must still reach the history and the tracking; the best stays the last kept.
                    log.warning("epoch %d has the best %s so far (%.6g) but its state could not be kept: %s",
                                epoch + 1, self.metric, value, exc)
                    return
                self.best, self.best_epoch, self.best_value, self.stale_epochs = best, epoch, value, 0
                log.info("epoch %d is the best so far (%s %.6g)", epoch + 1, self.metric, value)
            else:
                self.stale_epochs += 1
            if self.early.enabled and self.stale_epochs >= self.early.patience:
                self._stop(EARLY_STOP, f"epoch {epoch + 1}: {self.metric} has not improved for "
                                       f"{self.stale_epochs} epoch(s) (train.early_stopping.patience="
                                       f"{self.early.patience})", epoch)

    def request_stop(self, kind: str, reason: str, epoch: int) -> None:
        """Stop at the end of ``epoch`` for a reason of the caller's (shardline tune's pruner), keeping the
        best epoch so far as any stop does."""
        with self._lock:
            if self.stop is None:
                self._stop(kind, reason, epoch)

    def _diverged(self, loss: float) -> bool:
        # Also over the first epoch's loss: worse than where training started, not a wobble of a loss that
        # has fallen to 1e-4 (1e-3 is 10x that, and harmless).
        return not math.isfinite(loss) or (math.isfinite(self.lowest_train_loss)
                                           and loss > self.divergence.factor * self.lowest_train_loss
                                           and loss > self.first_train_loss)

    def _value(self, row: dict) -> Optional[float]:
        value = row.get(self.metric)
        if value is None:
            if not self._warned_metric:
                log.warning("train.early_stopping.metric=%s is not in the epoch rows (keys %s); the best epoch "
                            "is chosen by train_loss", self.metric, sorted(k for k in row if "/" not in k))
                self._warned_metric = True
            self.metric = "train_loss"
            value = row.get("train_loss")
        return None if value is None or not math.isfinite(float(value)) else float(value)

    def _stop(self, kind: str, reason: str, epoch: int) -> None:
        self.stop = self._info(kind, reason)
        kept = f"; keeping epoch {self.best_epoch + 1}" if self.best_epoch is not None else ""
        log.warning("stopping training (%s): %s%s", kind.replace("_", " "), reason, kept)
        if epoch < self.epochs - 1:  # after the last epoch the workers are finishing anyway
            self._abort(f"training stopped by the driver ({kind.replace('_', ' ')}): {reason}")

    def _info(self, kind: str, reason: str) -> StopInfo:
        return StopInfo(kind, reason, self.best_epoch, None if self.best is None else int(self.best["step"]),
                        self.best_value, self.metric)

    # -- the attempt's end -------------------------------------------------------------------------
    def accounts_for(self, failure: WorkerTrainingFailedError) -> bool:
        """Whether a failed attempt is this monitor's stop (then the run ends with the best epoch)."""
        with self._lock:
            if self.stop is None and self.guard:
                non_finite = [f for f in failure.failures.values() if "NonFiniteError" in f.error]
                if non_finite:
                    self.stop = self._info(DIVERGED, f"rank {non_finite[0].rank}: " + non_finite[0].error.strip()
                                           .splitlines()[0][:1000])
                    log.warning("divergence guard: %s", self.stop.reason)
            if self.stop is None:
                return False
            if self.best is None:
                log.warning("training stopped (%s) before any epoch completed: there is no best epoch to keep",
                            self.stop.kind)
                return False
            return True

    def final(self) -> Optional[StopInfo]:
        """The stop, or (early stopping on, training complete) the best epoch when it is not the last."""
        if self.stop is not None or self.best is None:
            return self.stop
        if self.early.enabled and self.best_epoch != self.epochs - 1:
            return self._info("best_epoch", f"training completed; epoch {self.best_epoch + 1} had the best "
                                            f"{self.metric}")
        return None


def training_monitor(cfg, *, snapshot: Callable[[], dict], abort: Callable[[str], None],
                     stoppable: bool = False) -> Optional[TrainingMonitor]:
    """The run's monitor, or None when nothing may stop it early (``stoppable``: the caller may ask)."""
    from pipeline.config.train_options import divergence_on

    t = cfg.train
    guard = divergence_on(cfg)
    if not (t.early_stopping.enabled or guard or stoppable):
        return None
    return TrainingMonitor(t.early_stopping, t.divergence, t.epochs, snapshot=snapshot, abort=abort, guard=guard)


def epoch_lr(cfg, row: dict, version: int, steps_per_epoch: int, offset: int = 0) -> Optional[float]:
    """The learning rate of the epoch's last update (``train.schedule`` set; else None: it is train.lr)."""
    from pipeline.launch.plans import consistency
    from pipeline.ps.modes.consistency import expected_version
    from pipeline.ps.modes.schedule import schedule_spec

    t = cfg.train
    total = offset + steps_per_epoch * t.epochs
    if t.backend == "ps" and cfg.ps.mode != "average":  # the server's schedule counts its versions
        total, last = expected_version(consistency(cfg), total, cfg.parallelism.data), version - 1
    else:  # the replicas' local optimizers count their own steps
        last = int(row.get("step", 0)) - 1
    spec = schedule_spec(cfg, total)
    return None if spec is None else t.lr * spec.factor(max(last, 0))


def report_stop(run, cfg, stopped: Optional[dict]) -> None:
    """Tag the MLflow ``run`` with why its model is the best epoch's; with train.divergence.on_divergence
    =fail a divergence then fails the run (DivergedError) so nothing downstream promotes it."""
    from pipeline.errors import DivergedError

    if not stopped:
        return
    info = StopInfo(**stopped)
    run.set_tags(info.tags())
    if info.kind == DIVERGED:
        kept = (f"the model is epoch {info.best_epoch + 1}'s (step {info.best_step})" if info.best_epoch is not None
                else "no epoch to keep")
        log.warning("training diverged: %s; %s (MLflow tag shardline.diverged=true)", info.reason, kept)
        if cfg.train.divergence.on_divergence == "fail":
            raise DivergedError(f"training diverged: {info.reason}; {kept}; the run is tagged shardline.diverged "
                                "(train.divergence.on_divergence=fail; set it to warn to keep the best epoch's model)")
    elif info.best_epoch is not None:
        log.info("the run's model is epoch %d's: %s", info.best_epoch + 1, info.reason)
