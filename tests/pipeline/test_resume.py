"""The driver dies mid-training (SIGKILL to its whole process group) and `--resume` finishes the run.

Real processes: `shardline train` runs in a subprocess with its own Spark session and is killed once
it has checkpointed; `spark-submit jobs/train.py --resume` then continues from the newest checkpoint.
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.checkpoints import CheckpointStore
from pipeline.config import load
from pipeline.errors import ConfigError
from pipeline.etl import run_etl
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "MLFLOW_DISABLE_TELEMETRY": "true", "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def test_killed_driver_resumes_from_its_last_checkpoint(spark, conf_dir, tmp_path):
    config = os.path.join(conf_dir, "digits.yaml")
    overrides = [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "train.checkpoint_every=40",
                 "tracking.log_model=false"]
    cfg = load(config, overrides)
    manifest = run_etl(spark, cfg)
    planned = steps_per_epoch(manifest, cfg.parallelism.data, cfg.train.batch_size) * cfg.train.epochs
    checkpoints = os.path.join(tmp_path, "checkpoints", cfg.name)

    # A slow first driver (rank 0 sleeps 30 ms per step) so it is surely mid-training when killed.
    first = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", "--config", config, *overrides,
         "faults.delay_rank=0", "faults.delay_ms=30"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not glob.glob(os.path.join(checkpoints, "ckpt-*.pt")):
            assert first.poll() is None, first.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # the driver and its JVM, with no chance to clean up
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    store = CheckpointStore(checkpoints)
    killed_at = store.latest().step
    assert 0 < killed_at < planned
    run_id = store.load(store.latest())["extra"]["mlflow_run_id"]

    resumed = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", "local[2]",
         "--conf", "spark.ui.enabled=false", os.path.join(REPO, "jobs", "train.py"), "--resume",
         "--config", config, *overrides],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    match = re.search(r"resuming from checkpoint \S+ at step (\d+) of (\d+)", output)
    assert match and int(match.group(1)) >= killed_at and int(match.group(2)) == planned, output[-4000:]
    assert f"training done: {planned} steps" in output
    assert f"mlflow run id: {run_id}" in output  # the same MLflow run continued
    from mlflow.tracking import MlflowClient

    # epochs the killed driver logged after its last checkpoint are trained again, but logged once
    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(cfg.train.epochs))
    final = store.load(store.latest())
    assert final["step"] == planned
    assert final["ps"]["steps_applied_by_rank"] == {0: planned, 1: planned}
    assert len(store.list()) <= cfg.train.keep_checkpoints
    assert torch.equal(final["ps"]["params"], torch.load(
        os.path.join(tmp_path, "models", cfg.name, "model.pt"), weights_only=True)["parameters"])


def test_resume_refuses_a_checkpoint_of_another_model(spark, conf_dir, tmp_path):
    from pipeline.launch import train

    cfg = load(os.path.join(conf_dir, "digits.yaml"), [f"workdir={tmp_path}", "train.epochs=1"])
    manifest = run_etl(spark, cfg)
    train(spark, cfg, manifest)
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hidden": [32]})})
    with pytest.raises(ConfigError, match=r"cannot resume from checkpoint .*ckpt-.*its model is .*start fresh"):
        train(spark, other, manifest, resume=True)
    with pytest.raises(ConfigError, match=r"no checkpoint in .*train.checkpoint_dir"):
        train(spark, cfg.model_copy(update={"name": "never-trained"}), manifest, resume=True)
