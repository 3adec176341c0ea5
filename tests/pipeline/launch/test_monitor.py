"""Early stopping and the divergence guard on the epoch rows (launch.monitor), without Spark: the rows
and the failures are the ones the driver assembles."""
from __future__ import annotations

import math

import pytest

from pipeline.config.train_options import DivergenceConfig, EarlyStoppingConfig
from pipeline.errors import WorkerFailure, WorkerTrainingFailedError
from pipeline.launch.monitor import DIVERGED, EARLY_STOP, StopInfo, TrainingMonitor, report_stop


class Recorder:
    def __init__(self):
        self.step = 0
        self.aborted: list[str] = []

    def snapshot(self) -> dict:
        return {"step": self.step, "ps": {"params": [self.step]}}

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


def _monitor(early=None, divergence=None, epochs=10):
    rec = Recorder()
    monitor = TrainingMonitor(early or EarlyStoppingConfig(), divergence or DivergenceConfig(), epochs,
                              snapshot=rec.snapshot, abort=rec.abort)
    return monitor, rec


def _feed(monitor, rec, rows):
    for epoch, row in enumerate(rows):
        rec.step = 10 * (epoch + 1)
        monitor.on_epoch({"epoch": epoch, "step": rec.step, **row})


def test_early_stopping_after_patience_keeps_the_best_epoch_and_aborts_the_workers():
    monitor, rec = _monitor(EarlyStoppingConfig(enabled=True, metric="val_loss", patience=2))
    _feed(monitor, rec, [{"train_loss": 1.0, "val_loss": 0.9}, {"train_loss": 0.8, "val_loss": 0.5},
                         {"train_loss": 0.7, "val_loss": 0.6}, {"train_loss": 0.6, "val_loss": 0.55},
                         {"train_loss": 0.5, "val_loss": 0.1}])  # the last row comes after the stop: ignored
    assert monitor.stop.kind == EARLY_STOP and monitor.stop.best_epoch == 1 and monitor.stop.best_step == 20
    assert monitor.best == {"step": 20, "ps": {"params": [20]}}
    assert len(rec.aborted) == 1 and "has not improved for 2 epoch(s)" in rec.aborted[0]
    failure = WorkerTrainingFailedError({0: WorkerFailure(0, "PSError: " + rec.aborted[0])})
    assert monitor.accounts_for(failure)
    tags = monitor.final().tags()
    assert tags["shardline.best_epoch"] == "2" and tags["shardline.stopped"] == EARLY_STOP


def test_accuracy_is_maximized_and_a_completed_run_restores_its_best_epoch():
    monitor, rec = _monitor(EarlyStoppingConfig(enabled=True, metric="val_accuracy", patience=5), epochs=3)
    _feed(monitor, rec, [{"train_loss": 1.0, "val_accuracy": 0.5}, {"train_loss": 0.9, "val_accuracy": 0.9},
                         {"train_loss": 0.8, "val_accuracy": 0.7}])
    assert monitor.stop is None and rec.aborted == []
    final = monitor.final()
    assert final.kind == "best_epoch" and final.best_epoch == 1 and final.best_value == 0.9


def test_a_completed_run_whose_last_epoch_is_best_has_nothing_to_restore():
    monitor, rec = _monitor(EarlyStoppingConfig(enabled=True, patience=5), epochs=2)
    _feed(monitor, rec, [{"train_loss": 1.0, "val_loss": 1.0}, {"train_loss": 0.9, "val_loss": 0.8}])
    assert monitor.final() is None


@pytest.mark.parametrize("loss", [50.0, math.inf, math.nan])
def test_a_loss_over_factor_times_the_best_or_not_finite_is_a_divergence(loss):
    monitor, rec = _monitor(divergence=DivergenceConfig(enabled=True, factor=10))
    _feed(monitor, rec, [{"train_loss": 2.0, "val_loss": 1.0}, {"train_loss": 1.0, "val_loss": 2.0},
                         {"train_loss": 9.0, "val_loss": 3.0}, {"train_loss": loss, "val_loss": 3.0}])
    assert monitor.stop.kind == DIVERGED and "epoch 4" in monitor.stop.reason
    assert monitor.stop.best_epoch == 0  # the best val_loss, not the lowest train loss
    assert len(rec.aborted) == 1


def test_a_tiny_loss_wobbling_by_more_than_factor_is_not_a_divergence_until_worse_than_the_first_epoch():
    monitor, rec = _monitor(divergence=DivergenceConfig(enabled=True, factor=10))
    _feed(monitor, rec, [{"train_loss": 0.5, "val_loss": 1.0}, {"train_loss": 1e-4, "val_loss": 0.5},
                         {"train_loss": 2e-3, "val_loss": 0.5}])  # 20x the best, still below where it started
    assert monitor.stop is None and rec.aborted == []
    monitor.on_epoch({"epoch": 3, "step": 40, "train_loss": 0.6, "val_loss": 2.0})
    assert monitor.stop.kind == DIVERGED and "over the first epoch's 0.5" in monitor.stop.reason


def test_without_the_guard_a_huge_loss_does_not_stop_training():
    monitor, rec = _monitor(divergence=DivergenceConfig(enabled=False))
    _feed(monitor, rec, [{"train_loss": 1.0, "val_loss": 1.0}, {"train_loss": 1e9, "val_loss": 1e9}])
    assert monitor.stop is None and rec.aborted == []


def test_the_guard_takes_a_non_finite_failure_only_when_an_epoch_was_kept():
    nan = WorkerTrainingFailedError({1: WorkerFailure(1, "NonFiniteError: rank 1: the training loss is nan at "
                                                         "step 7 (epoch 0)", retryable=False)})
    monitor, rec = _monitor(divergence=DivergenceConfig(enabled=True))
    assert not monitor.accounts_for(nan)  # no epoch completed: nothing to keep, the run fails as before
    monitor, rec = _monitor(divergence=DivergenceConfig(enabled=True))
    _feed(monitor, rec, [{"train_loss": 1.0, "val_loss": 1.0}])
    assert monitor.accounts_for(nan)
    assert monitor.stop.kind == DIVERGED and "rank 1" in monitor.stop.reason and monitor.stop.best_epoch == 0
    other = WorkerTrainingFailedError({0: WorkerFailure(0, "InjectedFault: boom")})
    assert not _monitor(divergence=DivergenceConfig(enabled=True))[0].accounts_for(other)


def test_a_missing_metric_falls_back_to_train_loss():
    monitor, rec = _monitor(EarlyStoppingConfig(enabled=True, metric="val_loss", patience=1))
    _feed(monitor, rec, [{"train_loss": 1.0}, {"train_loss": 2.0}])
    assert monitor.stop.kind == EARLY_STOP and monitor.stop.metric == "train_loss" and monitor.stop.best_epoch == 0


class FakeRun:
    """Only set_tags is used; the real MLflow round trip is in the Spark tests."""

    def __init__(self):
        self.tags = {}

    def set_tags(self, tags):
        self.tags.update(tags)


def test_on_divergence_fail_tags_the_run_then_raises():
    from pipeline.config import build
    from pipeline.errors import DivergedError

    info = StopInfo(DIVERGED, "epoch 3: train loss nan is not finite", 1, 20, 0.4, "val_loss").to_dict()
    run = FakeRun()
    cfg = build({"train": {"divergence": {"enabled": True, "on_divergence": "fail"}}})
    with pytest.raises(DivergedError, match="epoch 2's"):
        report_stop(run, cfg, info)
    assert run.tags["shardline.diverged"] == "true" and run.tags["shardline.best_epoch"] == "2"
    run = FakeRun()
    report_stop(run, build({"train": {"divergence": {"enabled": True}}}), info)  # warn: no raise
    assert run.tags["shardline.diverged"] == "true"


def test_a_best_epoch_whose_state_cannot_be_taken_keeps_the_last_best_and_does_not_raise(caplog):
    """ps.placement=hosts: a shard dies as an epoch completes; the epoch row must still reach the history."""
    from pipeline.errors import PSError

    monitor, rec = _monitor(EarlyStoppingConfig(enabled=True, metric="val_loss", patience=5))
    _feed(monitor, rec, [{"train_loss": 1.0, "val_loss": 0.9}])

    def dead() -> dict:
        raise PSError("parameter server shard 1 (host 1 10.0.0.2, pid 7) died")

    monitor._snapshot = dead
    monitor.on_epoch({"epoch": 1, "step": 20, "train_loss": 0.5, "val_loss": 0.4})
    assert monitor.best == {"step": 10, "ps": {"params": [10]}} and monitor.best_epoch == 0
    assert "epoch 2 has the best val_loss so far (0.4) but its state could not be kept" in caplog.text
    assert "shard 1 (host 1 10.0.0.2, pid 7) died" in caplog.text
