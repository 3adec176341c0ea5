"""Host-level faults on the multi-host testbed, each on a real spark-submit run: a host cut off for a
while, a host powered off, a host cut off for good (the run goes on without it, and the host's stale
rank cannot come back into it), the driver's host cut off from every worker.

Rank 0 sleeps 40 ms a step (faults.delay_*) so that 12 epochs last long enough to strike at epoch 3."""
from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.slow
EPOCHS = 12
SLOW = ["faults.delay_rank=0", "faults.delay_ms=40", "faults.attempts=9", f"train.epochs={EPOCHS}",
        "train.checkpoint_every=20"]
EPOCH_3 = rf"epoch 3/{EPOCHS} \|"


def _run_record(run):
    """(the MLflow run, its per-epoch train_loss history) of a finished job."""
    from mlflow import MlflowClient

    run_id = re.search(r"mlflow run id: (\w+)", run.output).group(1)
    client = MlflowClient(run.tracking_uri)
    return client.get_run(run_id), client.get_metric_history(run_id, "train_loss"), client


def _final_checkpoint(bed, run, monkeypatch):
    """The newest checkpoint the run wrote on the testbed's S3 (read with the testbed's credentials)."""
    from pipeline.checkpoints import CheckpointStore

    url = next(o.split("=", 1)[1] for o in run_overrides(run) if o.startswith("train.checkpoint_dir="))
    import s3fs

    for key, value in bed.s3_env().items():
        monkeypatch.setenv(key, value)
    try:
        store = CheckpointStore(url)
        return store.load(store.latest())
    finally:
        # fsspec keeps one S3FileSystem per constructor arguments, and the endpoint comes from the environment:
        # left cached, a later test's s3fs would talk to this testbed's S3 server (gone by then)
        s3fs.S3FileSystem.clear_instance_cache()


def run_overrides(run) -> list[str]:
    return [arg for arg in run.proc.args if "=" in arg and not arg.startswith(("spark.", "--"))]


def test_a_host_cut_off_for_less_than_the_step_deadline_is_named_and_the_run_completes(
        testbed, cluster_run, monkeypatch):
    run = cluster_run(["parallelism.data=2", *SLOW, "timeouts.step_s=60", "timeouts.stall_s=4"], executors=2)
    run.wait_for(EPOCH_3, 240)
    rank1 = run.ranks_hosts(timeout_s=30)[1]
    host = testbed.host_of(rank1)
    testbed.cut(host.index)
    cut_at = time.monotonic()
    try:
        warning, warned_at = run.wait_for(r"WARNING .*rank\(s\) (.*) silent for ([\d.]+)s \(timeouts.stall_s=4\)"
                                          r".*", 40)
    finally:
        time.sleep(max(0.0, 12 - (time.monotonic() - cut_at)))  # a 12 s cut, well inside the 60 s deadline
        testbed.heal(host.index)
    print(f"stall WARNING {warned_at - cut_at:.1f}s after the cut (timeouts.stall_s=4)")
    assert f"1 on host {rank1}" in warning.group(1), warning.group(0)
    assert "rank(s) [0] wait for them" in warning.group(0) and "timeouts.step_s=60s" in warning.group(0)
    assert "attempt 2 of 3 (train.max_attempts)" in warning.group(0)
    run.wait_for(rf"rank 1 on host {re.escape(rank1)} was heard from again after [\d.]+s of silence", 30)
    assert run.finish() == 0, run.output[-6000:]
    assert "barrier attempt 2" not in run.output  # nothing failed: the same attempt went on

    record, losses, client = _run_record(run)
    assert sorted(m.step for m in losses) == list(range(EPOCHS))  # every epoch's row once
    stalls = {m.step: m.value for m in client.get_metric_history(record.info.run_id, "rank1/stall_s")}
    assert len(stalls) == EPOCHS and max(stalls.values()) >= 8, stalls  # the cut shows in the epoch(s) it hit
    assert all(m.value == 0 for m in client.get_metric_history(record.info.run_id, "rank0/stall_s"))
    final = _final_checkpoint(testbed, run, monkeypatch)
    steps = final["step"]
    assert final["ps"]["steps_applied_by_rank"] == {0: steps, 1: steps}  # every (rank, step) applied once
    # only the epoch the silence fell in says so on its line
    assert re.search(rf"epoch {EPOCHS}/{EPOCHS} \|.*silent: rank 1", run.output) is None


def test_a_host_powered_off_fails_the_run_at_once_naming_it(testbed, cluster_run):
    run = cluster_run(["parallelism.data=3", *SLOW, "timeouts.step_s=30", "timeouts.slots_s=5",
                       "train.max_attempts=3"], executors=3)
    run.wait_for(EPOCH_3, 240)
    lost = testbed.host_of(run.ranks_hosts(timeout_s=30)[2])
    try:
        testbed.power_off(lost.index)
        off_at = time.monotonic()
        assert run.finish(timeout_s=240) != 0
        ended = time.monotonic() - off_at
    finally:
        testbed.revive(lost.index)
    print(f"powered off: the run ended {ended:.1f}s later")
    output = run.output
    assert f"the barrier needs 3 task slots, the cluster has 2 now (1 missing: host(s) {lost.address} left" in output
    assert "set train.min_workers=2 to go on with the hosts that are left" in output
    assert "barrier attempt 2" not in output  # no attempt waits for slots that are not there
    assert "requires 3 slots, but only 2 are available" not in output  # nor Spark's retry loop


def test_a_host_cut_off_for_good_goes_on_without_it_and_its_stale_rank_stays_out(testbed, cluster_run, monkeypatch):
    run = cluster_run(["parallelism.data=3", *SLOW, "timeouts.step_s=8", "timeouts.stall_s=3",
                       "timeouts.slots_s=3", "train.min_workers=2"], executors=3)
    run.wait_for(EPOCH_3, 240)
    lost = testbed.host_of(run.ranks_hosts(timeout_s=30)[2])
    testbed.cut(lost.index)
    cut_at = time.monotonic()
    try:
        _, shrunk_at = run.wait_for(r"ELASTIC RETRY: .*", 120)
        testbed.heal(lost.index)  # the link comes back after the run gave up on the host
        assert run.finish(timeout_s=300) == 0, run.output[-6000:]
    finally:
        testbed.heal(lost.index)
    print(f"cut for good: the run went on with 2 workers {shrunk_at - cut_at:.1f}s after the cut")
    output = run.output
    assert f"host {lost.address} does not answer" in output
    assert f"1 missing: host(s) {lost.address} left" in output
    after = output[output.index("ELASTIC RETRY"):]
    assert "ELASTIC RESUME" in after and "3 -> 2 workers" in after
    assert f"connected from ('{lost.address}'" not in after  # nothing from the lost host joins the new run
    resumed_at = int(re.search(r"ELASTIC RESUME at step (\d+)", after).group(1))
    final = _final_checkpoint(testbed, run, monkeypatch)
    # Every (rank, step) once: three ranks up to the shrink, then ranks 0 and 1; nothing of the stale rank
    # 2 after it, although its link came back while the run went on.
    assert final["ps"]["steps_applied_by_rank"] == {0: final["step"], 1: final["step"], 2: resumed_at}
    record, losses, _ = _run_record(run)
    assert sorted(m.step for m in losses) == list(range(EPOCHS))  # every epoch's row once, across the shrink


def test_the_drivers_host_cut_off_from_every_worker_for_a_while_is_survived(testbed, cluster_run):
    run = cluster_run(["parallelism.data=2", *SLOW, "timeouts.step_s=60", "timeouts.stall_s=4"], executors=2)
    run.wait_for(EPOCH_3, 240)
    for host in testbed.hosts:
        testbed.cut(host.index)
    try:
        run.wait_for(r"rank\(s\) .* silent for", 40)
        time.sleep(6)  # ~10 s in all, inside the deadline (and Spark's own heartbeat timeout)
    finally:
        for host in testbed.hosts:
            testbed.heal(host.index)
    assert run.finish() == 0, run.output[-6000:]
    assert "barrier attempt 2" not in run.output
    _, losses, _ = _run_record(run)
    assert sorted(m.step for m in losses) == list(range(EPOCHS))
