"""ps.server_processes on a real local Spark session: the driver's PS shards in child processes, one of
them SIGKILLed mid-run; the attempt fails naming it and the retry resumes from the newest checkpoint."""
import os
import signal
import threading
import time

import psutil
import pytest

from pipeline.config import Workdir, build
from pipeline.etl import run_etl
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


def _shard_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "pipeline.ps.processes.shard_process" in " ".join(p.cmdline())]


def _kill_a_shard_after_the_first_checkpoint(store, killed: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        children = _shard_children()
        if len(children) == 2 and store.latest() is not None:
            victim = children[-1]
            killed["pid"] = victim.pid
            killed["step"] = store.latest().step
            os.kill(victim.pid, signal.SIGKILL)
            return
        time.sleep(0.02)


def test_a_sigkilled_shard_process_fails_the_attempt_naming_it_and_the_retry_resumes(spark, tmp_path):
    from pipeline.checkpoints import CheckpointStore

    cfg = build({"name": "shard-procs", "workdir": str(tmp_path), "parallelism": {"data": 2},
                 "data": {"source": "digits"}, "model": {"hidden": [32]},
                 "train": {"epochs": 2, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "checkpoint_every": 10},
                 "ps": {"shards": 2, "server_processes": True, "timeout_s": 20},
                 # rank 0 is held 20 ms a step in the first attempt, so the kill lands mid-run
                 "faults": {"delay_rank": 0, "delay_ms": 20}})
    manifest = run_etl(spark, cfg)
    planned = steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    killed: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_shard_after_the_first_checkpoint,
                              args=(CheckpointStore(Workdir.of(cfg).checkpoints), killed, stop), daemon=True)
    killer.start()
    try:
        result = train(spark, cfg, manifest)
    finally:
        stop.set()
        killer.join(5)

    assert killed, "no shard process was killed"
    assert result.steps == planned
    [failure] = result.failed_attempts
    # One clear error naming the shard: its index, pid, address and how it died.
    assert f"pid {killed['pid']}" in failure["error"] and "SIGKILL" in failure["error"], failure["error"]
    assert "parameter server shard" in failure["error"] and "127.0.0.1:" in failure["error"]
    assert 0 < failure["step"] <= planned
    applied = {int(k): v for k, v in result.ps_stats["steps_applied_by_rank"].items()}
    assert applied == {0: planned, 1: planned}  # every (rank, step) applied once across both attempts
    assert [row["epoch"] for row in result.history] == list(range(cfg.train.epochs))
    assert not _shard_children()  # every child reaped, the revived one too
