"""``ps.tls: true`` end to end on local Spark: the per-job certificate reaches the workers with the secret,
the PS connections and the pipeline stage links run over TLS, and the job trains as without it."""
import logging

import pytest

from pipeline.config import build, with_changes
from pipeline.etl import run_etl
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("tls")
    cfg = build({"name": "tls", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"hidden": [32]},
                 "train": {"epochs": 2, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "checkpoint_every": 0},
                 "ps": {"timeout_s": 20, "tls": True}})
    return cfg, run_etl(spark, cfg)


def test_a_tiny_job_trains_over_tls(spark, digits, caplog):
    cfg, manifest = digits
    assert cfg.ps.tls is True
    caplog.set_level(logging.INFO, logger="pipeline.ps.transport.listener")
    result = train(spark, cfg, manifest)
    connected = [r.getMessage() for r in caplog.records if "connected from" in r.getMessage()]
    assert len(connected) == 2 and all("TLSv1.3" in line for line in connected), connected
    assert result.steps == steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"] * 1.5
    assert result.ps_stats["rejected_connections"] == 0  # every rank got through TLS and the HMAC handshake


def test_pipeline_stage_links_and_the_task_hosted_ps_over_tls(spark, digits):
    cfg, manifest = digits
    hosted = with_changes(cfg, ps={"placement": "task"})
    result = train(spark, hosted, manifest)
    assert result.steps == steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    staged = with_changes(cfg, name="tls-pp", parallelism={"data": 1, "pipeline": 2, "micro_batches": 2})
    result = train(spark, staged, run_etl(spark, staged))
    assert result.steps > 0 and result.history[-1]["stage0/bytes_sent"] > 0
