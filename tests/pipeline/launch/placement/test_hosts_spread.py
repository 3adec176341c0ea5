"""ps.placement=hosts on a real local Spark session: the host's first barrier task starts the shard process,
the driver attaches it over the control link, trains, takes the state back and ends it. One host here
(local[2]: one shard); tests/cluster runs 2 and 3 hosts and their faults."""
import os
import signal
import threading
import time

import pytest
import torch

from pipeline.config import build, with_changes
from pipeline.etl import run_etl
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("hosts_ps")
    cfg = build({"name": "hosts-ps", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"hidden": [64]},
                 "train": {"epochs": 4, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
                 "ps": {"placement": "hosts", "timeout_s": 20}})
    return cfg, run_etl(spark, cfg)


def test_hosts_placement_trains_exactly_like_the_driver_placement(spark, digits):
    cfg, manifest = digits
    spread = train(spark, cfg, manifest)
    driver = train(spark, with_changes(cfg, name="hosts-ps-driver", ps={"placement": "driver"}), manifest)

    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    assert spread.steps == driver.steps == steps
    # Sync mode, the same seed, two ranks (a commutative fp32 sum): the same bits.
    assert torch.equal(spread.parameters, driver.parameters)
    assert [round(r["train_loss"], 6) for r in spread.history] == [round(r["train_loss"], 6) for r in driver.history]
    # The shard ran in a process of its own (started by rank 0's task), not in this driver.
    assert spread.ps_stats["pid"] != os.getpid()
    assert "pid" not in driver.ps_stats
