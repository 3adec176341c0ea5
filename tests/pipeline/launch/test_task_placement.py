"""ps.placement=task on a real local Spark session: the PS runs inside rank 0's barrier task, its address
is shared with allGather, and the final parameters and history come back as result rows."""
import pytest

from pipeline.config import build, with_changes
from pipeline.errors import WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from pipeline.launch.task import rows as task_module
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("task_ps")
    cfg = build({"name": "task-ps", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"hidden": [128, 64]},
                 "train": {"epochs": 12, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "checkpoint_every": 50},
                 "ps": {"placement": "task", "timeout_s": 20}})
    return cfg, run_etl(spark, cfg)



def test_task_hosted_ps_trains_digits_and_returns_parameters_as_rows(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    result = train(spark, cfg, manifest)

    assert result.steps == steps * cfg.train.epochs
    assert [row["epoch"] for row in result.history] == list(range(cfg.train.epochs))
    assert result.ps_stats["steps_applied_by_rank"] in ({0: result.steps, 1: result.steps},
                                                        {"0": result.steps, "1": result.steps})
    # The PS ran in a Python worker of the barrier stage, not in this (the driver's) process.
    import os

    assert all(not r["process"].endswith(f"/{os.getpid()}") for r in result.ranks)
    accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    assert accuracy >= 0.95, accuracy
    # The task-side checkpointer wrote to train.checkpoint_dir, ending with the final state.
    from pipeline.checkpoints import CheckpointStore
    from pipeline.config import Workdir

    latest = CheckpointStore(Workdir.of(cfg).checkpoints).latest()
    assert latest is not None and latest.step == result.steps


def test_a_killed_rank_is_retried_from_the_task_ps_checkpoint(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    planned = steps * 4
    kill_at = 2 * steps + 3
    # Warm workers run this toy model at ~800 steps/s, faster than the checkpointer's 0.1 s poll can see
    # the step-`steps` boundary before the kill: rank 0 is held 10 ms a step so the periodic one lands.
    killed = with_changes(cfg, name="task-ps-kill", train={"epochs": 4, "checkpoint_every": steps},
                          faults={"kill_rank": 1, "kill_step": kill_at, "delay_rank": 0, "delay_ms": 10})
    result = train(spark, killed, manifest)

    assert result.steps == planned
    [failure] = result.failed_attempts
    # Spark tears the stage down when a task dies, so the rank is named from Spark's report.
    assert failure["ranks"] == [1] and "the task of rank 1 died" in failure["error"]
    # The retry resumed from this run's newest checkpoint (periodic — written at least every `steps`
    # steps, later under load — or rank 0's on the way down), not from scratch.
    assert 0 < failure["step"] <= kill_at
    applied = {int(k): v for k, v in result.ps_stats["steps_applied_by_rank"].items()}
    assert applied == {0: planned, 1: planned}
    assert [row["epoch"] for row in result.history] == [0, 1, 2, 3]


def test_failure_in_every_attempt_names_the_rank(spark, digits):
    cfg, manifest = digits
    failing = with_changes(cfg, name="task-ps-fail", train={"epochs": 1, "max_attempts": 2},
                           faults={"fail_rank": 1, "fail_step": 2, "attempts": 5})
    with pytest.raises(WorkerTrainingFailedError, match=r"gave up after 2 attempt\(s\)") as info:
        train(spark, failing, manifest)
    assert list(info.value.failures) == [1]
    assert "injected failure on rank 1" in info.value.failures[1].error


def test_parameters_are_split_into_chunks_and_reassembled(monkeypatch):
    monkeypatch.setattr(task_module, "CHUNK_BYTES", 10)
    row = {**task_module.failure_row(0, None, ""), "ok": True, "parameters": bytes(range(35)), "ps_report": "{}"}
    batches = list(task_module.to_batches(row))
    assert [b.num_rows for b in batches] == [1, 1, 1, 1]
    rows = [r for b in reversed(batches) for r in b.to_pylist()]  # any order from Spark
    other = [r for b in task_module.to_batches({**row, "rank": 1, "parameters": None}) for r in b.to_pylist()]
    merged = task_module.merge_chunks(rows + other)
    assert [m["rank"] for m in merged] == [0, 1]
    assert merged[0]["parameters"] == bytes(range(35)) and merged[0]["ps_report"] == "{}"
    assert merged[1]["parameters"] is None
    with pytest.raises(ValueError, match="chunks"):
        task_module.merge_chunks([r for r in rows if r["chunk"] != 1])  # a lost middle chunk


def test_allreduce_backend_with_the_task_hosted_ps(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    allreduce = with_changes(cfg, name="task-ps-allreduce", train={"backend": "allreduce", "epochs": 3})
    result = train(spark, allreduce, manifest)

    assert result.steps == 3 * steps
    assert len({r["parameters_digest"] for r in result.ranks}) == 1  # replicas agree
    assert [row["epoch"] for row in result.history] == [0, 1, 2]
    accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    assert accuracy >= 0.85, accuracy


def test_a_rank_stuck_past_the_deadline_is_torn_down_by_rank_0_and_the_retry_completes(spark, digits):
    """Only rank 0's task can stop a task-hosted attempt: when a rank neither finishes nor fails within
    ps.timeout_s, rank 0 fails its own task (Spark then kills the whole barrier stage) and sends the PS's
    account of the failure in the error, which the driver decodes."""
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    # ps.timeout_s also bounds connecting, which a fresh Python worker on a loaded machine can take
    # seconds for: 4 s, with a stall of 12 s that clearly exceeds it.
    stuck = with_changes(cfg, name="task-ps-stuck", train={"epochs": 2}, ps={"timeout_s": 4.0},
                         faults={"delay_rank": 1, "delay_step": steps + 3, "delay_ms": 12000})
    result = train(spark, stuck, manifest)

    assert result.steps == 2 * steps
    [failure] = result.failed_attempts
    assert "rank(s) 1 had not pushed step" in failure["error"]
    assert "rank 0 (which hosts the PS) stopped the barrier stage" in failure["error"]
