"""train.profile's per-step breakdown: real ranks in threads against a real parameter server (no Spark).

The acceptance of issue 17 item 1 is about accounting, not speed: the parts of a step add up to the step
time measured by the loop's own epoch clock (within 10%), no part is counted twice (the parts never
exceed the step), and with profiling off no clock is read and no key appears.
"""
import dataclasses
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.launch.ps_side.progress import EpochProgress
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
from pipeline.ps.modes.consistency import Consistency
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import WorkerPlan, run
from pipeline.worker import timing
from pipeline.worker.plan import Deadlines, FaultPlan, LoaderPlan

PARTS = [f"time/{phase}_ms" for phase in timing.PHASES]


def _shard(path, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": y}), path)
    return str(path)


def _train(tmp_path, *, profile, mode="sync", epochs=2, steps=8, world=2, faults=None):
    spec = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))
    optimizer = OptimizerSpec(lr=0.1, momentum=0.9)
    plans = [WorkerPlan(rank=r, world_size=world, generation=1,
                        train_files=(_shard(tmp_path / f"s{r}.parquet", 64, r),), validation_files=(),
                        model=spec, features_field="features", label_field="label", epochs=epochs,
                        steps_per_epoch=steps, seed=0, loader=LoaderPlan(prefetch=2), optimizer=optimizer,
                        deadlines=Deadlines.all(10), profile=profile,
                        faults=faults or FaultPlan()) for r in range(world)]
    torch.manual_seed(0)
    settings = PSSettings(optimizer=optimizer, consistency=Consistency(mode),
                          step_timeout=Timeout.of(10, STEP_KEY))
    progress, reports, errors = EpochProgress(world, epochs), [], {}

    def on_metrics(rank, metrics):
        if "epoch" in metrics:
            reports.append(dict(metrics))
        progress(rank, metrics)

    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), settings, world_size=world, secret=secret,
                         host="127.0.0.1", on_metrics=on_metrics) as server:
        def target(plan):
            try:
                run(plan, *server.address, secret)
            except Exception as exc:  # collected for the assertion below
                errors[plan.rank] = exc

        threads = [threading.Thread(target=target, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == {}
        stats = server.stats
    assert len(reports) == world * epochs and len(progress.history) == epochs
    return reports, progress.history, stats


@pytest.mark.parametrize("mode", ["sync", "async", "average"])
def test_the_parts_of_every_epoch_add_up_to_its_step_time(tmp_path, mode):
    reports, history, stats = _train(tmp_path, profile=True, mode=mode)
    for metrics in [*reports, *history]:  # each rank's report and the driver's epoch row
        assert set(PARTS) <= set(metrics) and "time/step_ms" in metrics and "time/other_ms" in metrics
        parts = sum(metrics[key] for key in PARTS)
        assert metrics["time/step_ms"] > 0
        assert 0.9 * metrics["time/step_ms"] <= parts <= metrics["time/step_ms"] * (1 + 1e-9), (mode, metrics)
        assert metrics["time/other_ms"] == pytest.approx(metrics["time/step_ms"] - parts, abs=1e-6)
        # the phases that must have happened in every mode did, so the sum is not of zeros
        assert metrics["time/forward_ms"] > 0 and metrics["time/backward_ms"] > 0
        assert metrics["time/push_ms"] > 0 and metrics["time/pull_wait_ms"] > 0
        assert metrics["time/load_params_ms"] > 0
    for report in reports:  # the loop's own step clock is what the breakdown is held against
        assert report["time/step_ms"] == pytest.approx(1000 * report["step_time_s"])
    for row in history:
        assert row["time/step_ms_max"] >= row["time/step_ms"]
    # the server's side: every applied update timed
    assert stats["timed_updates"] == stats["pushes_applied"] if mode == "async" else stats["timed_updates"] > 0
    assert stats["time_optimizer_s"] > 0 and stats["time_reduce_s"] > 0
    assert (stats["time_sync_wait_s"] > 0) == (mode != "async")


def test_a_slow_rank_shows_as_its_own_data_wait_and_as_its_peers_pull_wait(tmp_path):
    # faults.slow_rank sleeps before each of rank 0's steps, where its loader's next() is: rank 0's data_wait
    # holds the sleep (a lower bound a sleep guarantees), and rank 1, in sync, waits for rank 0 in pull_wait.
    slow_s = 0.05
    reports, _, stats = _train(tmp_path, profile=True, epochs=1, faults=FaultPlan(slow_rank=0, slow_s=slow_s))
    assert len(reports) == 2  # one epoch, two ranks
    slow = max(reports, key=lambda r: r["time/data_wait_ms"])
    fast = min(reports, key=lambda r: r["time/data_wait_ms"])
    assert slow["time/data_wait_ms"] >= 1000 * slow_s  # a sleep's lower bound, whatever the machine's load
    # Relations, not bounds: the fast rank's wait is the slow rank's sleep, the slow rank finds its peer's
    # push already there.
    assert fast["time/pull_wait_ms"] > slow["time/pull_wait_ms"]
    assert fast["time/pull_wait_ms"] > fast["time/data_wait_ms"]
    assert stats["time_sync_wait_ms_per_update"] > 0.5 * 1000 * slow_s  # the server saw the same wait


def test_sync_server_times_one_update_per_step(tmp_path):
    _, _, stats = _train(tmp_path, profile=False, epochs=1)
    assert stats["timed_updates"] == 8
    assert stats["time_optimizer_ms_per_update"] == pytest.approx(1000 * stats["time_optimizer_s"] / 8)


def test_profile_off_reports_no_time_keys(tmp_path):
    reports, history, _ = _train(tmp_path, profile=False, epochs=1)
    assert all(not timing.timing_keys(m) for m in [*reports, *history])
    assert all("step_time_s" in m for m in reports)  # the existing metrics are still there


def test_the_null_timer_reads_no_clock(monkeypatch):
    reads = []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: reads.append(1) or 0.0)
    off = timing.step_timer(False)
    off.start()
    for phase in timing.PHASES:
        off.lap(phase)
    assert off.take(1.0, 10) == {} and reads == []
    timing.step_timer(True).lap("forward")
    assert reads  # the patch does catch the enabled timer's reads


def test_summarize_and_table():
    rows = {0: {"time/forward_ms": 2.0, "time/step_ms": 4.0, "time/pull_wait_ms": 0.5, "loss": 1.0},
            1: {"time/forward_ms": 4.0, "time/step_ms": 8.0, "time/pull_wait_ms": 2.5},
            2: {"time/forward_ms": 3.0, "time/step_ms": 6.0, "time/pull_wait_ms": 1.5}}
    assert timing.summarize(rows) == {"time/forward_ms": 3.0, "time/step_ms": 6.0, "time/pull_wait_ms": 1.5,
                                      "time/step_ms_max": 8.0, "time/pull_wait_ms_min": 0.5,
                                      "time/pull_wait_ms_max": 2.5}
    assert timing.summarize({0: {"loss": 1.0}}) == {}
    text = timing.table({"time/forward_ms": 3.0, "time/step_ms": 6.0})
    assert "forward" in text and "50.0%" in text and text.splitlines()[-1].startswith("step")


def test_a_synced_timer_waits_for_the_device_before_each_reading():
    # what a CUDA worker's timer does with torch.cuda.synchronize (no GPU here: a counting stand-in)
    syncs = []
    timer = timing.StepTimer(sync=lambda: syncs.append(1))
    for phase in timing.PHASES:
        timer.lap(phase)
    assert len(syncs) == len(timing.PHASES)
    assert isinstance(timing.step_timer(True, "cpu"), timing.StepTimer)
    assert isinstance(timing.step_timer(False, "cuda:0"), timing.NullTimer)


def test_server_epoch_timing_is_the_difference_since_the_last_row():
    from pipeline.ps.server.timing import EpochTiming

    epochs = EpochTiming()
    first = epochs.row({"time_reduce_s": 0.01, "time_optimizer_s": 0.02, "time_sync_wait_s": 0.0, "timed_updates": 10})
    assert first == pytest.approx({"ps/reduce_ms": 1.0, "ps/optimizer_ms": 2.0, "ps/sync_wait_ms": 0.0,
                                   "ps/updates": 10})
    second = epochs.row({"time_reduce_s": 0.04, "time_optimizer_s": 0.02, "time_sync_wait_s": 0.1, "timed_updates": 20})
    assert second == pytest.approx({"ps/reduce_ms": 3.0, "ps/optimizer_ms": 0.0, "ps/sync_wait_ms": 10.0,
                                    "ps/updates": 10})
