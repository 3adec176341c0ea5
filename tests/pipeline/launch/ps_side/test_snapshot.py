"""Checkpoint snapshots keep the epoch reports that belong to the PS state: a real server on 127.0.0.1,
real clients in threads, EpochProgress as the server's metrics hook (as train() wires it)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.checkpoints import CheckpointStore
from pipeline.launch.ps_side.progress import EpochProgress
from pipeline.launch.ps_side.snapshot import SnapshotNotReady, take_snapshot
from pipeline.checkpoints import Checkpointer
from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, PSSettings, new_secret
from pipeline.ps.modes.consistency import Consistency
from pipeline.wire.deadline import STEP_KEY, Timeout

STEPS_PER_EPOCH, EPOCHS, N = 2, 2, 4


def epoch_report(epoch: int, step: int, samples: int = 8) -> dict:
    return {"epoch": epoch, "step": step, "train_loss": 0.5, "samples": samples, "seconds": 1.0, "val_loss": 0.4}


@pytest.fixture
def ps():
    """(server, progress, clients) for two ranks; the factory takes the consistency mode."""
    opened = []

    def make(mode: str = "sync"):
        secret = new_secret()
        progress = EpochProgress(2, EPOCHS)
        settings = PSSettings(OptimizerSpec("sgd", lr=0.1), Consistency(mode), step_timeout=Timeout.of(5, STEP_KEY))
        server = ParameterServer(torch.zeros(N), settings, world_size=2, secret=secret, host="127.0.0.1",
                                 on_metrics=progress).start()
        clients = [PSClient(*server.address, rank=rank, secret=secret, timeout_s=5) for rank in (0, 1)]
        opened.append((server, clients))
        for client in clients:
            client.connect()
        return server, progress, clients

    yield make
    for server, clients in opened:
        for client in clients:
            client.close()
        server.close()


def sync_steps(clients, steps: range) -> None:
    """Both ranks push every step of ``steps`` (a sync step completes when both have pushed)."""
    with ThreadPoolExecutor(2) as pool:
        for step in steps:
            list(pool.map(lambda c: c.push_pull(step, torch.ones(N)), clients))


def test_a_snapshot_at_an_epoch_end_waits_for_every_ranks_report(ps):
    server, progress, clients = ps("sync")
    sync_steps(clients, range(STEPS_PER_EPOCH))  # epoch 0 stepped through, nobody has reported it yet
    snap = lambda: take_snapshot(server, progress, Consistency("sync"), STEPS_PER_EPOCH, EPOCHS)
    with pytest.raises(SnapshotNotReady, match="at step 2 but rank 0 has not reported epoch 0"):
        snap()
    clients[0].report(epoch_report(0, 2))
    with pytest.raises(SnapshotNotReady, match="rank 1 has not reported epoch 0"):
        snap()
    clients[1].report(epoch_report(0, 2))
    # What a checkpoint records besides (the same names as the arguments: the run's own values).
    state = take_snapshot(server, progress, Consistency("sync"), STEPS_PER_EPOCH, EPOCHS, epochs=EPOCHS,
                          steps_per_epoch=STEPS_PER_EPOCH, seed=7)
    assert state["step"] == 2 and [row["epoch"] for row in state["history"]] == [0] and state["pending"] == []
    assert (state["epochs"], state["steps_per_epoch"], state["seed"]) == (EPOCHS, STEPS_PER_EPOCH, 7)
    assert state["ps"]["version"] == 2


def test_reports_of_a_rank_ahead_travel_with_the_snapshot_and_complete_after_a_restore(ps):
    server, progress, clients = ps("async")
    for step in range(STEPS_PER_EPOCH):  # async: rank 0 runs through epoch 0 on its own
        clients[0].push(step, torch.ones(N))
    clients[0].report(epoch_report(0, 2, samples=8))
    clients[1].push(0, torch.ones(N))  # rank 1 is still inside epoch 0
    state = take_snapshot(server, progress, Consistency("async"), STEPS_PER_EPOCH, EPOCHS)
    assert state["history"] == [] and [(e, r) for e, r, _ in state["pending"]] == [(0, 0)]

    # The resumed run: rank 0 starts in epoch 1 and never reports epoch 0 again; rank 1's report completes it.
    rows = []
    resumed = EpochProgress(2, EPOCHS, rows.append)
    resumed.restore(state)
    resumed(1, epoch_report(0, 2, samples=24))
    [row] = rows
    assert row["epoch"] == 0 and row["samples_per_s"] == 32.0  # both ranks' samples in the epoch's row


def test_the_periodic_checkpoint_at_an_epoch_end_is_written_once_the_epoch_is_reported(ps, tmp_path):
    server, progress, clients = ps("sync")
    store = CheckpointStore(str(tmp_path), keep=3)
    snapshot = lambda: take_snapshot(server, progress, Consistency("sync"), STEPS_PER_EPOCH, EPOCHS)
    with Checkpointer(store, snapshot, lambda: server.version, every=STEPS_PER_EPOCH, poll_s=0.01) as checkpointer:
        sync_steps(clients, range(STEPS_PER_EPOCH))
        time.sleep(0.2)  # many polls while the reports are outstanding: each one is skipped
        assert checkpointer.saved == [] and store.list() == []
        for client in clients:
            client.report(epoch_report(0, 2))
        deadline = time.monotonic() + 10
        while not checkpointer.saved and time.monotonic() < deadline:
            time.sleep(0.01)
    [info] = store.list()
    saved = store.load(info)
    assert info.step == 2 and [row["epoch"] for row in saved["history"]] == [0]


def test_a_probe_that_is_not_ready_takes_no_state(ps):
    """The shards' version and clocks are asked first where taking the state costs (ps.placement=hosts: the
    shards write the whole model to the store): a snapshot that would be thrown away never takes it."""
    server, progress, clients = ps("sync")
    sync_steps(clients, range(STEPS_PER_EPOCH))  # epoch 0 stepped through, nobody has reported it yet
    taken = []

    class Costly:
        def state_dict(self):
            taken.append(1)
            return server.state_dict()

    probe = {"version": server.version, "clocks": {}}
    with pytest.raises(SnapshotNotReady, match="rank 0 has not reported epoch 0"):
        take_snapshot(Costly(), progress, Consistency("sync"), STEPS_PER_EPOCH, EPOCHS, probe=probe)
    assert taken == []
    for client in clients:
        client.report(epoch_report(0, STEPS_PER_EPOCH))
    state = take_snapshot(Costly(), progress, Consistency("sync"), STEPS_PER_EPOCH, EPOCHS, probe=probe)
    assert taken == [1] and state["step"] == STEPS_PER_EPOCH
