"""The barrier launch on a real local Spark session: failures, preflight, teardown."""
import threading
import time

import pytest

from pipeline.config import build
from pipeline.errors import ConfigError, WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.launch import train


@pytest.fixture(scope="module")
def shards(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("launch")
    cfg = build({"name": "launch", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "train": {"epochs": 2, "batch_size": 64}, "model": {"hidden": [16]},
                 "ps": {"timeout_s": 30}})
    return cfg, run_etl(spark, cfg)


def _ps_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ps-")]


def test_a_raising_worker_gives_one_exception_naming_its_rank(spark, shards):
    cfg, manifest = shards
    failing = cfg.model_copy(update={"faults": cfg.faults.model_copy(update={"fail_rank": 1, "fail_step": 3}),
                                     "train": cfg.train.model_copy(update={"max_attempts": 1})})
    with pytest.raises(WorkerTrainingFailedError) as info:
        train(spark, failing, manifest)
    error = info.value
    assert list(error.failures) == [1]  # the root cause only, not the peer it took down
    assert "InjectedFault" in error.failures[1].error and "step 3" in error.failures[1].error
    assert "rank 1" in error.failures[1].log_tail  # the worker's own log lines came back
    assert "rank(s) 1" in str(error)
    # the peer was released by rank 1's failure, not left to run into the deadline
    assert list(error.stopped) == [0]
    assert "rank 1" in error.stopped[0] and "ps.timeout_s" not in error.stopped[0]
    deadline = time.monotonic() + 10
    while _ps_threads() and time.monotonic() < deadline:  # PS torn down in `finally`
        time.sleep(0.1)
    assert _ps_threads() == []


def test_training_after_a_failure_succeeds_and_runs_planned_steps(spark, shards, caplog):
    import logging

    cfg, manifest = shards
    with caplog.at_level(logging.INFO, logger="pipeline.worker.remote"):
        result = train(spark, cfg, manifest)
    assert "[rank 0] INFO pipeline.worker.loop: rank 0 epoch 1: loss" in caplog.text  # streamed worker lines
    steps = -(-min(s.rows for s in manifest.split("train").shards) // cfg.train.batch_size)
    assert result.steps == steps * cfg.train.epochs
    assert [r["rank"] for r in result.ranks] == [0, 1] and all(r["ok"] for r in result.ranks)
    assert [row["epoch"] for row in result.history] == [0, 1]
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.ps_stats["pushes_applied"] == 2 * result.steps
    # Each rank evaluated half of the validation split; the epoch row is the whole split's, here that of the
    # final model (sync: every replica ends on the server's last parameters).
    _assert_last_val_is_the_whole_splits(result, manifest)


def _assert_last_val_is_the_whole_splits(result, manifest):
    import torch

    from pipeline.data import read_tensors
    from pipeline.models import loss_fn

    model = result.model().eval()
    x, y = read_tensors(manifest.files("validation"), manifest.features_field, manifest.label_field)
    assert len(y) == manifest.split("validation").rows > 2  # both ranks had rows to evaluate
    with torch.no_grad():
        output = model(x)
        loss = float(loss_fn(result.spec)(output, y))
        accuracy = int((output.argmax(dim=1) == y).sum()) / len(y)
    last = result.history[-1]
    assert last["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert last["val_accuracy"] == pytest.approx(accuracy, abs=1e-9)


def test_preflight_rejects_more_workers_than_slots(spark, shards):
    cfg, manifest = shards
    too_many = cfg.model_copy(update={"parallelism": cfg.parallelism.model_copy(update={"data": 3})})
    with pytest.raises(ConfigError, match=r"parallelism.data=3 workers need 3 concurrent task slots.*has 2"):
        train(spark, too_many, manifest)
