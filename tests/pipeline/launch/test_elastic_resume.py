"""--resume with another parallelism.data on real local Spark: a 2-worker run fails mid-epoch after a
checkpoint, a 1-worker run resumes it, and the rows trained on per epoch (faults.record_rows_dir) are every
train row exactly once — the interrupted epoch included."""
import collections
import logging

import pytest

from pipeline import steps
from pipeline.config import build, with_changes
from pipeline.data import read_tensors
from pipeline.errors import WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.launch import train
from pipeline.checkpoints import CheckpointStore
from pipeline.config.workdir import Workdir
from pipeline.shards import steps_per_epoch
from pipeline.worker.row_log import read_steps, row_digests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic")
    cfg = build({"name": "elastic", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"hidden": [32]},
                 "train": {"epochs": 2, "batch_size": 32, "checkpoint_every": 5, "max_attempts": 1},
                 "ps": {"timeout_s": 20}})
    return cfg, run_etl(spark, cfg), work


def test_two_workers_resumed_on_one_see_every_train_row_once_per_epoch(spark, digits):
    cfg, manifest, work = digits
    first_steps = steps_per_epoch(manifest, 2, 32)
    fail_at = first_steps + first_steps // 2  # mid second epoch
    # Rank 0 dawdles through the interrupted epoch (40 ms a step) so that the driver's checkpointer, which
    # polls every 0.1 s, lands a checkpoint in it whatever the machine's speed (a fast wire ran those
    # nine steps within one poll).
    first = with_changes(cfg, faults={"fail_rank": 1, "fail_step": fail_at, "record_rows_dir": str(work / "leg1"),
                                      "delay_rank": 0, "delay_ms": 40, "delay_step": first_steps})
    with pytest.raises(WorkerTrainingFailedError):
        train(spark, first, manifest)
    store = CheckpointStore(Workdir.of(cfg).checkpoints)
    resumed_at = store.latest().step
    assert first_steps < resumed_at <= fail_at  # a checkpoint inside the interrupted epoch

    one = with_changes(cfg, parallelism={"data": 1}, faults={"record_rows_dir": str(work / "leg2")})
    result = train(spark, one, manifest, resume=True)

    one_steps = steps_per_epoch(manifest, 1, 32)
    assert one_steps != first_steps
    assert result.resumed_from_step == resumed_at
    assert [row["epoch"] for row in result.history] == [0, 1]  # each epoch's row once
    # Every (rank, step) applied once: 2 ranks up to the checkpoint, then rank 0 alone.
    applied = result.ps_stats["steps_applied_by_rank"]
    assert applied[1] == resumed_at and applied[0] == result.steps
    steps = read_steps(str(work / "leg1"), below=resumed_at) + read_steps(str(work / "leg2"))
    assert len({(s["rank"], s["step"]) for s in steps}) == len(steps)
    assert {s["rank"] for s in read_steps(str(work / "leg2"))} == {0}

    x, y = read_tensors(manifest.files("train"), manifest.features_field, manifest.label_field,
                        manifest.num_features, manifest.feature_set)
    every_row = collections.Counter(row_digests(x, y))
    for epoch in range(cfg.train.epochs):
        seen = collections.Counter(d for s in steps if s["epoch"] == epoch for d in s["rows"])
        assert seen == every_row, f"epoch {epoch}: {sum((seen - every_row).values())} extra, " \
                                  f"{sum((every_row - seen).values())} missing"


def test_min_workers_trains_three_asked_on_two_slots_logged_loudly_and_in_mlflow(spark, digits, caplog):
    """train.min_workers end to end: the session is local[2], the shard set has 2 shards, 3 workers asked."""
    from mlflow.tracking import MlflowClient

    cfg, _, work = digits
    asked = with_changes(cfg, parallelism={"data": 3}, train={"min_workers": 2, "max_attempts": 3},
                         tracking={"uri": f"sqlite:///{work}/mlflow.db", "log_model": False})
    with caplog.at_level(logging.WARNING, logger="pipeline.launch.elastic"):
        outcome = steps.train(spark, asked)
    assert "parallelism.data=3 asked, only 2 task slot(s) available: training with 2 workers" in caplog.text
    run = MlflowClient(asked.tracking.uri).get_run(outcome.run_id)
    assert run.data.params["parallelism.data"] == "2" and run.data.params["parallelism.data_asked"] == "3"
    assert run.data.params["train.min_workers"] == "2"
    assert run.data.tags["shardline.workers"] == "2"
