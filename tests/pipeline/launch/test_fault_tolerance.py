"""Failures during training on a real local Spark session: killed workers, hung workers, driver retries.

Every case trains for real through the barrier stage and the driver's PS; faults come from the
faults.* hooks, which fire in the first attempt only, so the driver's retry can succeed.
"""
import logging

import pytest

from pipeline.config import build, with_changes
from pipeline.errors import WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    cfg = build({"name": "faults", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"hidden": [128, 64]},
                 "train": {"epochs": 20, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "checkpoint_every": 0},
                 "ps": {"timeout_s": 20}})
    return cfg, run_etl(spark, cfg)



def test_sigkilled_worker_mid_epoch_is_retried_without_losing_or_repeating_a_step(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    planned = steps * cfg.train.epochs
    kill_at = 5 * steps + steps // 2  # the middle of epoch 6
    result = train(spark, with_changes(cfg, faults={"kill_rank": 1, "kill_step": kill_at}), manifest)

    assert result.steps == planned
    assert len(result.failed_attempts) == 1 and result.failed_attempts[0]["ranks"] == [1]
    assert "closed its connection" in result.failed_attempts[0]["error"]
    stats = result.ps_stats
    assert stats["generations"] == 2
    # Each (rank, step) applied exactly once: the step cut by the kill was discarded and redone.
    assert stats["steps_applied_by_rank"] == {0: planned, 1: planned}
    assert [row["epoch"] for row in result.history] == list(range(cfg.train.epochs))
    accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    assert accuracy >= 0.95, accuracy


def test_hung_worker_fails_the_step_naming_its_rank_then_the_retry_succeeds(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    hung = with_changes(cfg, train={"epochs": 2}, ps={"timeout_s": 2.0},
                        faults={"delay_rank": 0, "delay_step": steps + 3, "delay_ms": 6000})
    result = train(spark, hung, manifest)

    assert result.steps == 2 * steps
    [failure] = result.failed_attempts
    assert "rank(s) 0 had not pushed step" in failure["error"] and "timed out after 2s" in failure["error"]
    assert failure["step"] == steps + 3  # detected at the stalled step, not later
    assert result.ps_stats["steps_applied_by_rank"] == {0: 2 * steps, 1: 2 * steps}


def test_a_worker_failing_in_every_attempt_exhausts_max_attempts(spark, digits, caplog):
    cfg, manifest = digits
    failing = with_changes(cfg, train={"epochs": 1, "max_attempts": 2},
                           faults={"fail_rank": 0, "fail_step": 2, "attempts": 5})
    with caplog.at_level(logging.WARNING, logger="pipeline.launch"):
        with pytest.raises(WorkerTrainingFailedError, match=r"gave up after 2 attempt\(s\) \(train.max_attempts=2\)") as info:
            train(spark, failing, manifest)
    assert info.value.attempt == 2 and list(info.value.failures) == [0]
    assert "attempt 1 of 2 failed; retrying from step 2" in caplog.text


def _uneven_manifest(manifest, sizes):
    """The same shard set with train shards of the given row counts (rows taken from the real ones)."""
    import dataclasses
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data import read_tensors
    from pipeline.shards.manifest import Shard, ShardFile, SplitShards

    inputs, labels = read_tensors(manifest.files("train"), num_features=manifest.num_features)
    features = inputs["numeric"]
    shards, start = [], 0
    for index, rows in enumerate(sizes):
        relative = f"uneven/shard={index}/part-0.parquet"
        path = os.path.join(manifest.root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        x = features[start:start + rows].numpy()
        table = pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]),
                          "label": pa.array(labels[start:start + rows].numpy())})
        pq.write_table(table, path, row_group_size=64)
        groups = tuple(pq.ParquetFile(path).metadata.row_group(g).num_rows
                       for g in range(pq.ParquetFile(path).metadata.num_row_groups))
        shards.append(Shard(index, rows, (ShardFile(relative, rows, os.path.getsize(path), groups),)))
        start += rows
    train = SplitShards(sum(sizes), tuple(shards))
    return dataclasses.replace(manifest, splits={**manifest.splits, "train": train})


def test_very_uneven_shards_are_balanced_by_the_stream_cut(spark, digits):
    """Ranks read parts of one global row stream (pipeline.data.assignment), not a shard each: shards of
    40 and 900 rows still give both ranks 470 rows and the same steps."""
    import threading

    cfg, manifest = digits
    uneven = _uneven_manifest(manifest, [40, 900])  # one shard holds 22x the rows of the other
    quick = with_changes(cfg, train={"epochs": 2, "batch_size": 16}, ps={"timeout_s": 10})
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(result=train(spark, quick, uneven)), daemon=True)
    worker.start()
    worker.join(timeout=300)  # a hang fails here instead of blocking the suite
    assert not worker.is_alive(), "training on uneven shards hung"
    result = outcome["result"]
    steps = steps_per_epoch(uneven, 2, 16)
    assert steps == 30 and result.steps == 2 * steps  # ceil(470 / 16): half the rows each
    assert [r["samples"] for r in result.ranks] == [2 * 470, 2 * 470]  # every row once per epoch
    assert result.failed_attempts == []


def test_too_few_rows_for_a_batch_per_worker_are_refused_before_anything_starts(spark, digits):
    from pipeline.errors import DataError

    cfg, manifest = digits
    with pytest.raises(DataError, match=r"fewer than one batch per worker: train.batch_size=471"):
        train(spark, with_changes(cfg, train={"batch_size": 471}), _uneven_manifest(manifest, [0, 940]))


@pytest.mark.parametrize("factory, error", [("nan_mlp", "NonFiniteError"), ("rejecting_mlp", "ModelInputError")])
def test_a_failure_a_retry_cannot_cure_ends_the_run_after_one_attempt(spark, digits, user_models, factory, error,
                                                                      caplog):
    """A NaN/Inf loss, or a model that raises on its input, would fail every attempt the same way."""
    cfg, manifest = digits
    doomed = with_changes(cfg, name=f"doomed-{factory}", train={"epochs": 1, "max_attempts": 3},
                          model={"factory": f"{user_models}:{factory}"})
    with caplog.at_level(logging.WARNING, logger="pipeline.launch"):
        with pytest.raises(WorkerTrainingFailedError, match="not retried") as info:
            train(spark, doomed, manifest)
    assert info.value.attempt == 1
    assert "retrying" not in caplog.text
    assert all(f.retryable is False and error in f.error for f in info.value.failures.values()), info.value
