"""Pipeline (and hybrid data x pipeline) parallelism through the real barrier stage on local Spark."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import build, with_changes
from pipeline.errors import ConfigError, WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline_parallel")
    cfg = build({"name": "pp", "workdir": str(work), "parallelism": {"data": 1, "pipeline": 2, "micro_batches": 4},
                 "data": {"source": "digits"}, "model": {"hidden": [128, 64]},
                 "train": {"epochs": 8, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "checkpoint_every": 0},
                 "ps": {"timeout_s": 20}})
    return cfg, run_etl(spark, cfg)



def test_two_stage_pipeline_trains_digits_and_reports_per_stage_metrics(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 1, cfg.train.batch_size)
    result = train(spark, cfg, manifest)

    assert result.steps == steps * cfg.train.epochs
    # The merged model is the whole network again: evaluation needs nothing pipeline-specific.
    accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    assert accuracy >= 0.93, accuracy
    last = result.history[-1]
    for stage in (0, 1):
        assert 0 <= last[f"stage{stage}/bubble_fraction"] <= 1 and last[f"stage{stage}/compute_s"] > 0
        assert last[f"stage{stage}/bytes_sent"] > 0
    assert result.ps_stats["stages"] == 2
    assert result.ps_stats["steps_applied_by_rank"] == {0: result.steps, 1: result.steps}


def test_a_failing_stage_names_rank_and_stage_and_the_retry_completes(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 1, cfg.train.batch_size)
    failing = with_changes(cfg, name="pp-fail", train={"epochs": 2},
                           faults={"fail_rank": 1, "fail_step": steps + 2})
    result = train(spark, failing, manifest)
    assert result.steps == 2 * steps
    [failure] = result.failed_attempts
    assert failure["ranks"] == [1]
    assert "stage 1 of 2 (replica 0): InjectedFault" in failure["error"]

    always = with_changes(cfg, name="pp-fail-always", train={"epochs": 1, "max_attempts": 1},
                          faults={"fail_rank": 1, "fail_step": 1, "attempts": 5})
    with pytest.raises(WorkerTrainingFailedError) as info:
        train(spark, always, manifest)
    assert list(info.value.failures) == [1]  # the stage that failed, not its neighbour's broken link
    assert "stage 1 of 2" in str(info.value) and "rank 1" in str(info.value)


def test_preflight_counts_data_times_pipeline_tasks(spark, digits):
    cfg, manifest = digits
    with pytest.raises(ConfigError, match=r"parallelism.data x pipeline = 2 x 2 barrier tasks need 4 concurrent"):
        train(spark, with_changes(cfg, name="pp-too-many", parallelism={"data": 2, "pipeline": 2}), manifest)


HYBRID = """
import json, sys
sys.path.insert(0, {repo!r})
from pipeline.config import build, with_changes
from pipeline.session import get_or_create_spark
from pipeline import steps
cfg = build({{"name": "hybrid", "workdir": {work!r}, "spark": {{"master": "local[4]"}},
             "parallelism": {{"data": 2, "pipeline": 2, "micro_batches": 4}}, "data": {{"source": "digits"}},
             "model": {{"hidden": [128, 64]}}, "train": {{"epochs": 12, "batch_size": 16}},
             "tracking": {{"log_model": False}}}})
spark = get_or_create_spark(cfg.spark)
outcome = steps.run_all(spark, cfg)
import mlflow
run = mlflow.get_run(outcome.run_id)
# The same grid with train.backend=allreduce: each stage's two replicas average gradients in their own
# process group instead of through the stage's PS.
from pipeline.evaluate import evaluate
from pipeline.launch import train
allreduce = with_changes(cfg, name="hybrid-ar", train={{"backend": "allreduce"}})
manifest = steps.etl(spark, cfg)
trained = train(spark, allreduce, manifest)
ar_accuracy = evaluate(spark, manifest, trained.spec, trained.parameters, "test").metrics["accuracy"]
plots = [a.path for a in mlflow.MlflowClient().list_artifacts(outcome.run_id, "plots")]
print("RESULT " + json.dumps({{"metrics": outcome.test_metrics, "allreduce_accuracy": ar_accuracy, "plots": plots,
                              "allreduce_digests": len({{r["parameters_digest"] for r in trained.ranks}}),
                              "logged": sorted(k for k in run.data.metrics if k.startswith("stage"))}}))
"""


def test_hybrid_data_2_pipeline_2_on_four_barrier_tasks(tmp_path):
    """{data: 2, pipeline: 2}: four barrier tasks (a local[4] session in its own process; the shared test
    session has two slots), through ETL, training, evaluation and MLflow."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "MLFLOW_DISABLE_TELEMETRY": "true"}
    script = HYBRID.format(repo=str(REPO), work=str(tmp_path / "work"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["metrics"]["accuracy"] >= 0.93, result
    assert result["allreduce_accuracy"] >= 0.93, result
    assert result["allreduce_digests"] == 2  # one per stage: the replicas of each stage agree bit for bit
    for stage in (0, 1):
        assert f"stage{stage}/bubble_fraction" in result["logged"], result["logged"]
    assert "plots/pipeline_stages.png" in result["plots"], result["plots"]


def test_pipeline_checkpoints_resume_with_the_per_stage_servers(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 1, cfg.train.batch_size)
    first = train(spark, with_changes(cfg, name="pp-resume", train={"epochs": 2, "checkpoint_every": steps}),
                  manifest)
    assert first.steps == 2 * steps
    resumed = train(spark, with_changes(cfg, name="pp-resume", train={"epochs": 3, "checkpoint_every": steps}),
                    manifest, resume=True)
    assert resumed.resumed_from_step == 2 * steps and resumed.steps == 3 * steps
    assert [row["epoch"] for row in resumed.history] == [0, 1, 2]
