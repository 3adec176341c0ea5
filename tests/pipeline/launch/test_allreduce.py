"""train.backend=allreduce on a real local Spark session: DDP over gloo between the barrier tasks."""
import pytest
import torch

from pipeline.config import build, with_changes
from pipeline.errors import WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("allreduce")
    cfg = build({"name": "allreduce", "workdir": str(work), "parallelism": {"data": 2},
                 "data": {"source": "digits"}, "model": {"hidden": [128, 64]},
                 "train": {"backend": "allreduce", "epochs": 20, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
                 "ps": {"timeout_s": 20}})
    return cfg, run_etl(spark, cfg)



def test_allreduce_reaches_the_accuracy_bar_with_identical_replicas(spark, digits):
    cfg, manifest = digits
    result = train(spark, cfg, manifest)
    assert result.steps == steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    digests = {r["rank"]: r["parameters_digest"] for r in result.ranks}
    assert len(digests) == 2 and len(set(digests.values())) == 1  # bit-identical replicas
    assert [r["device"] for r in result.ranks] == ["cpu", "cpu"]
    assert result.ps_stats["pushes_applied"] == 0  # no gradient went through the server
    assert [row["epoch"] for row in result.history] == list(range(cfg.train.epochs))
    accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    assert accuracy >= 0.95, accuracy


@pytest.mark.parametrize("where", ["training", "rendezvous"])
def test_a_failing_rank_gives_one_exception_and_leaves_no_process_group(spark, digits, where):
    cfg, manifest = digits
    failing = with_changes(cfg, train={"epochs": 1, "max_attempts": 1}, ps={"timeout_s": 15},
                           faults={"fail_rank": 1, "fail_step": 3, "fail_in_rendezvous": where == "rendezvous"})
    with pytest.raises(WorkerTrainingFailedError) as info:
        train(spark, failing, manifest)
    assert list(info.value.failures) == [1]
    failure = info.value.failures[1]
    assert "InjectedFault" in failure.error
    assert ("at step 3" if where == "training" else "joining the allreduce process group") in failure.error
    assert "rank 1" in failure.log_tail
    assert not torch.distributed.is_initialized()
    # Spark reuses its Python workers: a process group or port left behind would break the next run.
    again = train(spark, with_changes(cfg, train={"epochs": 1}), manifest)
    assert again.steps == steps_per_epoch(manifest, 2, cfg.train.batch_size)
