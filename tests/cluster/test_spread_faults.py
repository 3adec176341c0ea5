"""ps.placement=hosts under host faults on the multi-host testbed: one shard process killed alone, a host
cut off for good (the slices re-spread over the hosts left, train.min_workers), a host powered off. Each
retry restarts every shard from the newest checkpoint (the same step on all of them), through the one
RetryPolicy, with the lost shard named in the error.

Rank 0 sleeps 40 ms a step (faults.delay_*) so that 8 epochs last long enough to strike at epoch 3."""
from __future__ import annotations

import os
import re
import signal

import pytest

from tests.cluster.test_host_faults import SLOW, _final_checkpoint, _run_record

pytestmark = pytest.mark.slow
# 8 epochs (the overrides after SLOW's 12 win): the strike lands at epoch 3 either way, and each run is a
# spark-submit of its own in the multi-host tests' ten minutes of CI.
SPREAD = ["ps.placement=hosts", "train.checkpoint_every=10", "train.epochs=8"]
SPREAD_EPOCHS = 8
EPOCH_3 = rf"epoch 3/{SPREAD_EPOCHS} \|"
STARTED = r"parameter server shard (\d+) \(host \d+ ([\d.]+), pid (\d+), [\d.]+:\d+, params \[\d+, \d+\)\) started"


def _shards(output: str) -> dict[int, tuple[str, int]]:
    """{shard: (host, pid)} of the newest attempt's shard processes, from the driver's log."""
    found: dict[int, tuple[str, int]] = {}
    for shard, host, pid in re.findall(STARTED, output):
        found[int(shard)] = (host, int(pid))
    return found


def _spread_hosts(output: str) -> list[list[str]]:
    """Each attempt's shard hosts, in shard order."""
    return [re.findall(r"on ([\d.]+):\d+", line) for line in re.findall(r"parameter server spread over .*", output)]


def test_one_shard_process_killed_alone_is_named_and_the_retry_restarts_every_shard_from_a_checkpoint(
        testbed, cluster_run, monkeypatch):
    run = cluster_run(["parallelism.data=3", *SLOW, *SPREAD, "timeouts.step_s=20"], executors=3)
    run.wait_for(EPOCH_3, 240)
    host, pid = _shards(run.output)[1]
    os.kill(pid, signal.SIGKILL)  # the testbed's namespaces share this machine's process ids
    assert run.finish(timeout_s=300) == 0, run.output[-6000:]
    output = run.output
    died = re.search(rf"parameter server shard 1 \(host 1 {re.escape(host)}, pid {pid}, .*\) died: its control "
                     r"link to the driver broke", output)
    assert died, output[-6000:]
    assert "barrier attempt 2" in output and "barrier attempt 3" not in output
    resumed = re.search(r"retrying from checkpoint step (\d+)|from checkpoint step (\d+)", output)
    assert resumed, output[-6000:]
    spread = _spread_hosts(output)
    assert len(spread) == 2 and all(len(h) == 3 for h in spread), spread  # every host serves a shard again
    final = _final_checkpoint(testbed, run, monkeypatch)
    steps = final["step"]
    assert final["ps"]["steps_applied_by_rank"] == {0: steps, 1: steps, 2: steps}  # every (rank, step) once
    _, losses, _ = _run_record(run)
    assert sorted(m.step for m in losses) == list(range(SPREAD_EPOCHS))


@pytest.mark.parametrize("strike", ["cut", "power_off"])
def test_a_host_lost_with_its_shard_goes_on_with_the_slices_respread(testbed, cluster_run, monkeypatch, strike):
    run = cluster_run(["parallelism.data=3", *SLOW, *SPREAD, "timeouts.step_s=8", "timeouts.stall_s=3",
                       "timeouts.slots_s=3", "train.min_workers=2"], executors=3)
    run.wait_for(EPOCH_3, 240)
    lost_address, _ = _shards(run.output)[2]
    lost = testbed.host_of(lost_address)
    try:
        getattr(testbed, strike)(lost.index)
        run.wait_for(r"ELASTIC RETRY: .*", 120)
        if strike == "cut":
            testbed.heal(lost.index)  # the link comes back after the run gave up on the host
        assert run.finish(timeout_s=300) == 0, run.output[-6000:]
    finally:
        if strike == "cut":
            testbed.heal(lost.index)
        else:
            testbed.revive(lost.index)
    output = run.output
    after = output[output.index("ELASTIC RETRY"):]
    assert "ELASTIC RESUME" in after and "3 -> 2 workers" in after
    spread = _spread_hosts(output)
    assert lost_address in spread[0] and len(spread[0]) == 3, spread
    # The retry's two shards (halves of the model, not thirds) on the two hosts left.
    assert len(spread[-1]) == 2 and lost_address not in spread[-1], spread
    resumed_at = int(re.search(r"ELASTIC RESUME at step (\d+)", after).group(1))
    final = _final_checkpoint(testbed, run, monkeypatch)
    assert final["ps"]["steps_applied_by_rank"] == {0: final["step"], 1: final["step"], 2: resumed_at}
    _, losses, _ = _run_record(run)
    assert sorted(m.step for m in losses) == list(range(SPREAD_EPOCHS))
