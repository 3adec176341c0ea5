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
                 "train": {"epochs": 4, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "profile": True},
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
    # train.profile: the shard's own reduce and optimizer times reach the epoch rows, as on the driver
    assert all(r["ps/updates"] > 0 and r["ps/reduce_ms"] > 0 for r in spread.history), spread.history[-1]


@pytest.mark.parametrize("first, then", [("hosts", "driver"), ("driver", "hosts")])
def test_a_checkpoint_resumes_across_placements_both_ways(spark, digits, first, then):
    from pipeline.errors import WorkerTrainingFailedError

    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    # Rank 0 lags 30 ms a step: digits' steps take ~1 ms, and a run at full speed reached the failing step
    # before the 0.1 s checkpoint poll had the shards write one set of parts (CI, stop 52).
    failing = with_changes(cfg, name=f"hosts-resume-{first}-{then}", ps={"placement": first},
                           train={"checkpoint_every": 10, "max_attempts": 1},
                           faults={"fail_rank": 1, "fail_step": steps // 2, "delay_rank": 0, "delay_ms": 30})
    with pytest.raises(WorkerTrainingFailedError, match="injected failure on rank 1"):
        train(spark, failing, manifest)
    if first == "hosts":  # the shards wrote their parts themselves; the checkpoint files name them
        from pipeline.checkpoints import CheckpointStore
        from pipeline.config.workdir import Workdir

        store = CheckpointStore(Workdir.of(failing).checkpoints)
        # The periodic ones are sets; one taken after the attempt ended holds the state the driver kept.
        records = [store.load(info)["ps"] for info in store.list()]
        sets = [r for r in records if "parts" in r]
        assert sets and all(len(r["parts"]) == 1 and "params" not in r for r in sets), records
    healthy = with_changes(failing, ps={"placement": then}, faults={"fail_rank": None, "delay_rank": None})
    resumed = train(spark, healthy, manifest, resume=True)
    assert 0 < resumed.resumed_from_step <= steps // 2
    assert resumed.steps == steps
    assert [r["epoch"] for r in resumed.history] == list(range(cfg.train.epochs))


def _host_shard_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"pipeline.ps.processes.host_shard" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_a_killed_shard_process_fails_the_attempt_naming_it_and_the_retry_finishes(spark, digits):
    cfg, manifest = digits
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size) * cfg.train.epochs
    slow = with_changes(cfg, name="hosts-kill", train={"checkpoint_every": 10},
                        faults={"delay_rank": 0, "delay_ms": 20})
    killed: list[int] = []
    from pipeline.checkpoints import CheckpointStore
    from pipeline.config import Workdir

    store = CheckpointStore(Workdir.of(slow).checkpoints)
    earlier = set(_host_shard_pids())  # an earlier test's shard may still be exiting

    def strike() -> None:  # the host's shard process, once training wrote its first periodic checkpoint
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = [pid for pid in _host_shard_pids() if pid not in earlier]
            if pids and store.latest() is not None:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            time.sleep(0.05)

    threading.Thread(target=strike, daemon=True).start()
    result = train(spark, slow, manifest)
    assert killed, "no shard process to kill"
    [failure] = result.failed_attempts
    assert f"pid {killed[0]}" in failure["error"] and "died: its control link to the driver broke" in failure["error"]
    assert 0 < failure["step"] < steps  # restarted from a checkpoint, not from scratch
    assert result.steps == steps
    assert [r["epoch"] for r in result.history] == list(range(cfg.train.epochs))


def test_sparse_tables_in_the_hosts_shards_score_like_the_driver_store(spark, tmp_path):
    """The clicks example's categorical tables as sparse rows in the host's shard process: the same rows, the
    same dense bits and the same ROC AUC as the driver-hosted tables (tests/cluster spreads them over hosts)."""
    import numpy as np

    from pipeline.config.loader import load
    from pipeline.evaluate import evaluate

    clicks = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "conf", "clicks.yaml")
    cfg = load(clicks, [f"workdir={tmp_path}", "data.clicks.rows=4000", "data.clicks.vocab=500",
                        "data.clicks.big_vocab=5000", "train.epochs=2", "train.batch_size=128", "model.hidden=[32]", "tracking.log_model=false",
                        "parallelism.data=2", "ps.sparse.min_rows=50", "ps.placement=hosts"])
    manifest = run_etl(spark, cfg)
    spread = train(spark, cfg, manifest)
    driver = train(spark, with_changes(cfg, ps={"placement": "driver"}), manifest)
    assert torch.equal(spread.parameters, driver.parameters)
    for name in ("c0", "c20"):
        ids, rows = (np.load(os.path.join(spread.spec.sparse["tables"], name, f)) for f in ("ids.npy", "rows.npy"))
        assert len(ids) and np.array_equal(ids, np.load(os.path.join(driver.spec.sparse["tables"], name, "ids.npy")))
        assert np.array_equal(rows, np.load(os.path.join(driver.spec.sparse["tables"], name, "rows.npy")))
    auc = [evaluate(spark, manifest, r.spec, r.parameters).metrics["roc_auc"] for r in (spread, driver)]
    assert auc[0] == auc[1] and auc[0] > 0.55, auc
    assert spread.ps_stats["sparse"]["rejected_frames"] == 0 and spread.ps_stats["pid"] != os.getpid()


def test_shards_that_cannot_write_their_parts_leave_the_checkpoints_to_the_driver(spark, digits, tmp_path, caplog):
    import logging

    from pipeline.checkpoints import CheckpointStore

    cfg, manifest = digits
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "parts").write_text("a file where the parts' folder would go: every shard's write fails")
    run = with_changes(cfg, name="hosts-parts-fallback", train={"checkpoint_every": 10, "checkpoint_dir": str(folder)})
    with caplog.at_level(logging.WARNING, logger="pipeline.launch.placement.hosts_spread"):
        result = train(spark, run, manifest)
    assert result.steps > 10
    assert "the shards could not write their checkpoint parts" in caplog.text
    record = CheckpointStore(str(folder)).load(CheckpointStore(str(folder)).latest())["ps"]
    assert "parts" not in record and record["params"].numel() == result.parameters.numel()
