"""The streaming row-group loader: exactly-once per epoch across ranks, seeded order, bounded memory."""
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data import StreamingLoader
from pipeline.data.shuffle import ShuffleBuffer
from pipeline.errors import DataError

pytestmark = pytest.mark.lts  # also run on the LTS stack


def _write(path, ids, width=4, row_group_size=64, fixed_size=False):
    """A shard file whose labels are unique row ids and whose features all equal the id."""
    ids = np.asarray(ids, dtype=np.int64)
    values = pa.array(np.repeat(ids.astype(np.float32), width))
    if fixed_size:
        features = pa.FixedSizeListArray.from_arrays(values, width)
    else:
        features = pa.ListArray.from_arrays(pa.array(np.arange(0, len(ids) * width + 1, width, dtype=np.int32)),
                                            values)
    pq.write_table(pa.table({"features": features, "label": pa.array(ids)}), path, row_group_size=row_group_size)
    return str(path)


def _rank_files(tmp_path, rows_per_rank, files_per_rank=2, row_group_size=64):
    start, plan = 0, []
    for rank, rows in enumerate(rows_per_rank):
        cuts = np.linspace(start, start + rows, files_per_rank + 1).astype(int)
        plan.append([_write(tmp_path / f"r{rank}-{i}.parquet", np.arange(cuts[i], cuts[i + 1]),
                            row_group_size=row_group_size + 7 * i) for i in range(files_per_rank)])
        start += rows
    return plan, start


def _epoch(loader, epoch):
    batches = [(x["numeric"], y) for x, y in loader.epoch(epoch)]
    for x, y in batches:  # features stay aligned with their labels
        assert x.dtype == torch.float32 and torch.equal(x[:, 0], y.float()) and torch.equal(x[:, -1], y.float())
    return batches


@pytest.mark.parametrize("shuffle,buffer,prefetch,threads", [
    (True, 1, 0, 1), (True, 13, 2, 1), (True, 200, 0, 3), (True, 100_000, 3, 2), (False, 50, 2, 1),
    (False, 1, 0, 2)])
def test_every_row_once_per_epoch_across_ranks(tmp_path, shuffle, buffer, prefetch, threads):
    rows = [401, 400, 402]
    files, total = _rank_files(tmp_path, rows)
    steps = -(-min(rows) // 32)
    loaders = [StreamingLoader(f, steps_per_epoch=steps, seed=5, rank=r, shuffle=shuffle,
                               shuffle_buffer_rows=buffer, prefetch=prefetch, reader_threads=threads)
               for r, f in enumerate(files)]
    for epoch in range(2):
        seen = []
        for loader in loaders:
            batches = _epoch(loader, epoch)
            assert len(batches) == steps
            sizes = [len(y) for _, y in batches]
            assert max(sizes) - min(sizes) <= 1
            seen += torch.cat([y for _, y in batches]).tolist()
        assert len(seen) == total and sorted(seen) == list(range(total))  # no loss, no duplicates
    if not shuffle:
        assert torch.cat([y for _, y in _epoch(loaders[1], 0)]).tolist() == list(range(401, 801))


def test_order_is_seeded_by_seed_rank_and_epoch_not_by_threads(tmp_path):
    files, _ = _rank_files(tmp_path, [300, 300])

    def order(seed, rank, epoch, prefetch=0, threads=1):
        loader = StreamingLoader(files[0], steps_per_epoch=5, seed=seed, rank=rank, shuffle_buffer_rows=64,
                                 prefetch=prefetch, reader_threads=threads)
        return torch.cat([y for _, y in loader.epoch(epoch)]).tolist()

    assert order(1, 0, 0) == order(1, 0, 0, prefetch=2, threads=3)
    assert order(1, 0, 0) != order(1, 0, 1)
    assert order(1, 0, 0) != order(1, 1, 0)
    assert order(1, 0, 0) != order(2, 0, 0)
    assert order(1, 0, 0) != sorted(order(1, 0, 0))  # actually shuffled


def test_memory_stays_bounded_on_a_shard_larger_than_the_buffer(tmp_path):
    rows, width, buffer, group = 200_000, 32, 4_096, 2_000
    path = _write(tmp_path / "big.parquet", np.arange(rows), width=width, row_group_size=group)
    shard_bytes = rows * width * 4  # 25.6 MB of features
    loader = StreamingLoader([path], steps_per_epoch=rows // 256, seed=0, rank=0, shuffle_buffer_rows=buffer,
                             prefetch=2, reader_threads=2)
    arrow_peak, count = 0, 0
    tracemalloc.start()
    try:
        for x, y in loader.epoch(0):
            count += len(y)
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes())
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == rows
    assert loader.peak_buffered_rows <= buffer + group
    # numpy (traced) and Arrow (its own pool) each hold a small fraction of the shard at any time
    assert numpy_peak < shard_bytes / 4, numpy_peak
    assert arrow_peak < shard_bytes / 4, arrow_peak


def test_fixed_size_list_features_and_manifest_counts(tmp_path):
    path = _write(tmp_path / "f.parquet", np.arange(100), width=3, row_group_size=30, fixed_size=True)
    loader = StreamingLoader([path], steps_per_epoch=4, seed=0, rank=0, row_group_rows=[[30, 30, 30, 10]],
                             num_features=3)
    assert loader.num_rows == 100
    assert sorted(torch.cat([y for _, y in _epoch(loader, 0)]).tolist()) == list(range(100))
    wrong = StreamingLoader([path], steps_per_epoch=4, seed=0, rank=0, row_group_rows=[[30, 30, 30, 11]])
    with pytest.raises(DataError, match=r"f.parquet row group 3 has 10 rows.*says 11"):
        list(wrong.epoch(0))


def test_abandoned_epoch_stops_the_threads_and_errors_are_clear(tmp_path):
    files, _ = _rank_files(tmp_path, [500])
    loader = StreamingLoader(files[0], steps_per_epoch=50, seed=0, rank=0, prefetch=2, reader_threads=2)
    iterator = loader.epoch(0)
    next(iterator)
    iterator.close()
    with pytest.raises(DataError, match="fewer than the 600 steps"):
        StreamingLoader(files[0], steps_per_epoch=600, seed=0, rank=0)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="bad.parquet"):
        StreamingLoader([str(bad)], steps_per_epoch=1, seed=0, rank=0)
    with pytest.raises(DataError, match="no shard files"):
        StreamingLoader([], steps_per_epoch=1, seed=0, rank=0)


def test_shuffle_buffer_takes_each_row_once():
    rng = np.random.default_rng(0)
    buffer = ShuffleBuffer(40, 2, np.int64, rng)
    taken = []
    for start in range(0, 100, 20):
        ids = np.arange(start, start + 20)
        buffer.add({"numeric": np.stack([ids, ids], axis=1).astype(np.float32)}, ids)
        while len(buffer) >= 15:
            x, y = buffer.take(7)
            assert np.array_equal(x["numeric"][:, 0], y)
            taken += y.tolist()
    while len(buffer):
        taken += buffer.take(min(7, len(buffer)))[1].tolist()
    assert sorted(taken) == list(range(100)) and taken != list(range(100))


@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_straddling_row_groups_are_independent_and_thread_count_free(tmp_path, shuffle):
    # batches (~53 rows) larger than the row groups (10 rows) and the buffer (8 rows): every batch is cut
    # from several taken blocks; batches that are views of one block must not alias each other
    path = _write(tmp_path / "s.parquet", np.arange(530), width=2, row_group_size=10)

    def epoch(prefetch, threads):
        loader = StreamingLoader([path], steps_per_epoch=10, seed=9, rank=0, shuffle=shuffle, shuffle_buffer_rows=8,
                                 prefetch=prefetch, reader_threads=threads)
        return _epoch(loader, 1)

    batches = epoch(0, 1)
    assert [len(y) for _, y in batches] == [53] * 10
    ids = torch.cat([y for _, y in batches]).tolist()
    assert sorted(ids) == list(range(530)) and (ids != list(range(530))) == shuffle
    assert ids == torch.cat([y for _, y in epoch(3, 2)]).tolist()
    before = [x.clone() for x, _ in batches]
    batches[0][0].fill_(-1.0)  # the caller may write into a batch in place
    assert all(torch.equal(x, b) for (x, _), b in zip(batches[1:], before[1:]))


def test_petastorm_reader_refuses_features_it_cannot_serve():
    from pipeline.config.feature_spec import FeatureSet, FeatureSpec

    features = FeatureSet((FeatureSpec(name="amount", type="numeric"), FeatureSpec(name="city", type="categorical")))
    with pytest.raises(DataError, match=r"petastorm serves numeric features only.*city \(categorical\).*data.reader=arrow"):
        StreamingLoader(["unused.parquet"], steps_per_epoch=1, seed=0, rank=0, reader="petastorm", features=features)


def test_a_reader_thread_keeps_only_its_newest_files_open(tmp_path, monkeypatch):
    # An open pre-buffered file on an object store keeps its last row group: an epoch over many files
    # must not keep them all open.
    import weakref

    import pipeline.storage as storage
    from pipeline.data import stream

    files, total = _rank_files(tmp_path, [900], files_per_rank=12, row_group_size=30)
    opened, alive = [], set()
    real = storage.open_parquet

    def counted(path, *args, **kwargs):
        handle = real(path, *args, **kwargs)
        opened.append(path)
        alive.add(id(handle))
        weakref.finalize(handle, alive.discard, id(handle))
        return handle

    monkeypatch.setattr(storage, "open_parquet", counted)
    most = [0]
    loader = StreamingLoader(files[0], steps_per_epoch=-(-total // 32), seed=5, rank=0, shuffle=True,
                             shuffle_buffer_rows=64, prefetch=0, reader_threads=1)
    seen = []
    for x, y in loader.epoch(0):
        most[0] = max(most[0], len(alive))
        seen += y.tolist()
    assert sorted(seen) == list(range(total))
    assert len(set(opened)) == 12 and most[0] <= stream.OPEN_FILES_PER_THREAD
