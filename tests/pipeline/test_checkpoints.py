"""CheckpointStore: atomic saves, pruning, and keeping an earlier run's checkpoints out of this run's way."""
import torch

from pipeline.checkpoints import CheckpointStore


def _save(store, step):
    return store.save({"step": step, "ps": {"params": torch.full((3,), float(step))}})


def test_an_earlier_runs_checkpoints_are_archived_so_this_runs_are_kept_and_found(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    for step in (800, 900, 1000):
        _save(store, step)
    assert [c.step for c in store.list()] == [900, 1000]  # pruned to keep=2

    assert store.archive_previous() == 2
    assert store.list() == [] and store.latest() is None
    assert sorted(p.name for p in (tmp_path / "ckpt" / "previous").iterdir()) == [
        "ckpt-000000000900.pt", "ckpt-000000001000.pt"]
    # A new run's low steps are no longer pruned away by the old run's higher ones.
    _save(store, 100)
    _save(store, 200)
    assert [c.step for c in store.list()] == [100, 200]
    assert store.load(store.latest())["ps"]["params"][0] == 200

    # The next run archives this one, replacing the older archive (at most one earlier run is kept).
    assert store.archive_previous() == 2
    assert sorted(p.name for p in (tmp_path / "ckpt" / "previous").iterdir()) == [
        "ckpt-000000000100.pt", "ckpt-000000000200.pt"]
    assert store.archive_previous() == 0  # nothing to move


def test_checkpoints_past_a_kept_epoch_are_set_aside_not_pruned_or_lost(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    for step in (10, 20, 30):
        _save(store, step)
    assert [c.step for c in store.list()] == [20, 30]  # keep=2 pruned 10
    assert store.set_aside_after(15) == 2
    assert store.list() == []
    _save(store, 15)  # the kept epoch's state, now the newest
    assert store.load(store.latest())["ps"]["params"][0] == 15
    aside = CheckpointStore(str(tmp_path / "ckpt" / "after_best"), keep=10)
    assert [c.step for c in aside.list()] == [20, 30]
