"""CheckpointStore: atomic saves, pruning, and keeping an earlier run's checkpoints out of this run's way."""
import pytest
import torch

from pipeline.checkpoints import CheckpointStore
from pipeline.errors import ConfigError


def _save(store, step):
    return store.save({"step": step, "ps": {"params": torch.full((3,), float(step))}})


def test_an_earlier_runs_checkpoints_are_archived_so_this_runs_are_kept_and_found(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    for step in (800, 900, 1000):
        _save(store, step)
    assert [c.step for c in store.list()] == [900, 1000]  # pruned to keep=2

    assert store.archive_previous() == 2
    assert store.list() == [] and store.latest() is None
    assert sorted(p.name for p in (tmp_path / "ckpt" / "previous").iterdir() if p.suffix == ".pt") == [
        "ckpt-000000000900.pt", "ckpt-000000001000.pt"]
    # A new run's low steps are no longer pruned away by the old run's higher ones.
    _save(store, 100)
    _save(store, 200)
    assert [c.step for c in store.list()] == [100, 200]
    assert store.load(store.latest())["ps"]["params"][0] == 200

    # The next run archives this one, replacing the older archive (at most one earlier run is kept).
    assert store.archive_previous() == 2
    assert sorted(p.name for p in (tmp_path / "ckpt" / "previous").iterdir() if p.suffix == ".pt") == [
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


def test_every_checkpoint_has_a_digest_that_travels_with_it(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    for step in (1, 2, 3):
        _save(store, step)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["ckpt-000000000002.pt", "ckpt-000000000002.pt.sha256", "ckpt-000000000003.pt",
                     "ckpt-000000000003.pt.sha256"]  # pruned with their checkpoint
    assert (tmp_path / "ckpt" / "ckpt-000000000003.pt.sha256").read_text().startswith("sha256:")
    store.archive_previous()
    previous = CheckpointStore(str(tmp_path / "ckpt" / "previous"))
    assert previous.load(previous.latest())["step"] == 3  # its digest was archived with it


def test_a_checkpoint_with_flipped_bytes_or_no_digest_is_refused_before_it_is_unpickled(tmp_path):
    import pytest

    from pipeline.errors import ConfigError

    store = CheckpointStore(str(tmp_path / "ckpt"))
    info = _save(store, 7)
    path = tmp_path / "ckpt" / "ckpt-000000000007.pt"
    data = bytearray(path.read_bytes())
    # A flip inside a stored tensor's bytes: torch.load alone would load it silently.
    at = data.find(torch.full((3,), 7.0).numpy().tobytes())
    assert at > 0
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"does not match its digest .*refusing to load it"):
        store.load(info)
    (tmp_path / "ckpt" / "ckpt-000000000007.pt.sha256").unlink()
    with pytest.raises(ConfigError, match=r"has no digest file .*refusing to load it"):
        store.load(info)


def test_with_a_key_the_digest_is_an_hmac_and_another_key_is_refused(tmp_path, monkeypatch):
    import pytest

    from pipeline.errors import ConfigError

    monkeypatch.setenv("SHARDLINE_ARTIFACT_KEY", "key-one")
    store = CheckpointStore(str(tmp_path / "ckpt"))
    info = _save(store, 5)
    assert (tmp_path / "ckpt" / "ckpt-000000000005.pt.sha256").read_text().startswith("hmac-sha256:")
    assert store.load(info)["step"] == 5
    monkeypatch.setenv("SHARDLINE_ARTIFACT_KEY", "key-two")
    with pytest.raises(ConfigError, match="does not match its digest"):
        store.load(info)
    monkeypatch.delenv("SHARDLINE_ARTIFACT_KEY")
    with pytest.raises(ConfigError, match=r"signed with a key .*SHARDLINE_ARTIFACT_KEY is not set"):
        store.load(info)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _paced(tmp_path, every=0, every_s=None):
    from pipeline.checkpoints import Checkpointer

    clock, version = Clock(), [0]
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=100)
    checkpointer = Checkpointer(store, lambda: {"step": version[0], "ps": {"params": torch.zeros(2)}},
                                lambda: version[0], every, every_s=every_s, clock=clock)
    return checkpointer, clock, version


def test_checkpoints_paced_in_time_need_the_seconds_and_a_new_step(tmp_path, caplog):
    checkpointer, clock, version = _paced(tmp_path, every_s=180)
    version[0] = 50
    clock.now += 179.9
    checkpointer.poll()
    assert checkpointer.saved == []  # steps, but not yet the time
    clock.now += 0.1
    with caplog.at_level("DEBUG", logger="pipeline.checkpoints"):
        checkpointer.poll()
    assert checkpointer.saved == [50]
    assert [r.levelname for r in caplog.records if "checkpoint at step 50 (every 180s)" in r.message] == ["DEBUG"]
    clock.now += 1000
    checkpointer.poll()
    assert checkpointer.saved == [50]  # the time, but no new step: nothing new to save
    version[0] = 51
    checkpointer.poll()
    assert checkpointer.saved == [50, 51]
    version[0] = 400  # a step count is no pace of its own here
    checkpointer.poll()
    assert checkpointer.saved == [50, 51]


def test_a_step_and_a_time_pace_save_at_whichever_comes_first(tmp_path):
    checkpointer, clock, version = _paced(tmp_path, every=100, every_s=60)
    version[0] = 100
    checkpointer.poll()
    assert checkpointer.saved == [100]  # the steps first, 0 s in
    clock.now += 59
    version[0] = 150
    checkpointer.poll()
    assert checkpointer.saved == [100]
    clock.now += 1  # 60 s after the last checkpoint (not after the start)
    checkpointer.poll()
    assert checkpointer.saved == [100, 150]


def test_one_info_line_per_epoch_sums_up_its_checkpoints(tmp_path, caplog):
    checkpointer, clock, version = _paced(tmp_path, every_s=10)
    assert checkpointer.summary() is None
    for step in (5, 9, 14):
        version[0] = step
        clock.now += 10
        checkpointer.poll()
    with caplog.at_level("INFO", logger="pipeline.checkpoints"):
        line = checkpointer.summary()
    assert line.startswith("3 checkpoint(s) since the last epoch line, the newest at step 14: ")
    assert line.endswith("ckpt-000000000014.pt")
    assert [r.message for r in caplog.records if r.levelname == "INFO"] == [line]
    assert checkpointer.summary() is None


def test_requested_checkpoints_are_info_lines_and_a_disabled_checkpointer_never_saves(tmp_path, caplog):
    from pipeline.checkpoints import Checkpointer

    checkpointer, clock, version = _paced(tmp_path, every_s=10)
    version[0] = 3
    with caplog.at_level("INFO", logger="pipeline.checkpoints"):
        checkpointer.save("end of training")
    assert any(r.levelname == "INFO" and "checkpoint at step 3 (end of training)" in r.message for r in caplog.records)
    off = Checkpointer(CheckpointStore(str(tmp_path / "off")), lambda: {"step": 9}, lambda: 9, 1, every_s=1,
                       enabled=False, clock=clock)
    clock.now += 100
    off.poll()
    off.save("end of training")
    assert off.saved == []


def _merge(parts, record):
    return {"params": torch.cat([p["params"] for p in parts]), **record}


def _save_set(store, step, token):
    """A checkpoint set as ps.placement=hosts writes it: each shard its part, then the record naming them."""
    from pipeline.ps.state.part_file import write_part

    parts = [write_part({"version": step, "params": torch.full((2,), float(step + i)), "clocks": {}},
                        store.parts_directory, f"{token}-shard-{i}-of-2.pt") for i in range(2)]
    return store.save({"step": step, "ps": {"version": step, "parts": [
        {k: p[k] for k in ("file", "digest", "bytes", "version")} for p in parts]}})


def test_a_set_of_shard_parts_loads_merged_and_its_parts_go_with_it(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2, merge_parts=_merge)
    for step, token in ((1, "a"), (2, "b"), (3, "c")):
        _save_set(store, step, token)
    (tmp_path / "ckpt" / "parts" / "e-shard-0-of-2.pt").write_bytes(b"a snapshot that was never committed")
    store.discard_parts("e-")
    _save_set(store, 4, "d")
    assert store.load(store.latest())["ps"]["params"].tolist() == [4.0, 4.0, 5.0, 5.0]
    # pruned with their checkpoints
    assert sorted(p.name for p in (tmp_path / "ckpt" / "parts").iterdir()) == [
        f"{t}-shard-{i}-of-2.pt" for t in "cd" for i in range(2)]
    # the record alone is enough for the metadata (no part is read)
    assert "parts" in CheckpointStore(str(tmp_path / "ckpt")).load(store.latest())["ps"]
    assert "parts" in store.load(store.latest(), parts=False)["ps"]

    assert store.archive_previous() == 2  # the parts move with their checkpoint
    previous = CheckpointStore(str(tmp_path / "ckpt" / "previous"), merge_parts=_merge)
    assert previous.load(previous.latest())["ps"]["params"].tolist() == [4.0, 4.0, 5.0, 5.0]


def test_a_missing_or_altered_part_is_refused_naming_it_before_it_is_unpickled(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), merge_parts=_merge)
    info = _save_set(store, 7, "t")
    part = tmp_path / "ckpt" / "parts" / "t-shard-1-of-2.pt"
    data = bytearray(part.read_bytes())
    data[-9] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"t-shard-1-of-2\.pt does not match the digest"):
        store.load(info)
    part.unlink()
    with pytest.raises(ConfigError, match=r"names the part .*t-shard-1-of-2\.pt, which is missing"):
        store.load(info)


def test_a_part_name_that_is_a_path_is_refused_written_or_read(tmp_path):
    import io

    from pipeline.checkpoints import FORMAT, CheckpointInfo, file_digest

    store = CheckpointStore(str(tmp_path / "ckpt"), merge_parts=_merge)
    forged = {"step": 1, "ps": {"version": 1, "parts": [{"file": "../../etc/passwd", "digest": "sha256:0"}]}}
    with pytest.raises(ConfigError, match="not a plain file name"):
        store.save(forged)
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())  # nothing written
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    buffer = io.BytesIO()
    torch.save({**forged, "format": FORMAT}, buffer)  # written by hand, as someone with the folder could
    path = tmp_path / "ckpt" / "ckpt-000000000001.pt"
    path.write_bytes(buffer.getvalue())
    (tmp_path / "ckpt" / "ckpt-000000000001.pt.sha256").write_text(file_digest(buffer.getvalue()))
    with pytest.raises(ConfigError, match="not a plain file name"):
        store.load(CheckpointInfo(str(path), 1))


def test_an_unreadable_checkpoint_keeps_its_parts_when_pruned(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=1, merge_parts=_merge)
    _save_set(store, 1, "a")
    (tmp_path / "ckpt" / "ckpt-000000000001.pt.sha256").write_text("sha256:" + "0" * 64)  # now unreadable
    fresh = CheckpointStore(str(tmp_path / "ckpt"), keep=1, merge_parts=_merge)  # knows nothing of it yet
    _save_set(fresh, 2, "b")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "parts").iterdir()) == [
        f"{t}-shard-{i}-of-2.pt" for t in "ab" for i in range(2)]  # a's parts left, not guessed at
