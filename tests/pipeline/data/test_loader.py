import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data import ShardLoader, read_tensors
from pipeline.errors import DataError


def _shard(path, rows, width=4, start=0):
    values = np.arange(start, start + rows, dtype=np.float32).repeat(width).reshape(rows, width)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32)),
                                        pa.array(values.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": pa.array(np.arange(start, start + rows))}), path)
    return str(path)


def test_read_tensors_concatenates_files(tmp_path):
    files = [_shard(tmp_path / "a.parquet", 5), _shard(tmp_path / "b.parquet", 3, start=5)]
    x, y = read_tensors(files)
    assert x.shape == (8, 4) and x.dtype == torch.float32
    assert y.tolist() == list(range(8)) and y.dtype == torch.int64
    assert torch.equal(x[:, 0], y.float())


def test_each_epoch_covers_every_row_once_in_the_planned_steps(tmp_path):
    x, y = read_tensors([_shard(tmp_path / "a.parquet", 101)])
    loader = ShardLoader(x, y, steps_per_epoch=7, seed=3, rank=1, prefetch=2)
    for epoch in range(3):
        batches = list(loader.epoch(epoch))
        assert len(batches) == 7
        sizes = [len(b[1]) for b in batches]
        assert max(sizes) - min(sizes) <= 1
        seen = torch.cat([b[1] for b in batches]).tolist()
        assert sorted(seen) == list(range(101))
        for features, labels in batches:  # features stay aligned with their labels
            assert torch.equal(features[:, 0], labels.float())


def test_shuffle_is_seeded_per_epoch_and_rank(tmp_path):
    x, y = read_tensors([_shard(tmp_path / "a.parquet", 64)])

    def order(seed, rank, epoch, prefetch=0):
        loader = ShardLoader(x, y, steps_per_epoch=4, seed=seed, rank=rank, prefetch=prefetch)
        return torch.cat([b[1] for b in loader.epoch(epoch)]).tolist()

    assert order(1, 0, 0) == order(1, 0, 0) == order(1, 0, 0, prefetch=3)
    assert order(1, 0, 0) != order(1, 0, 1)
    assert order(1, 0, 0) != order(1, 1, 0)
    assert order(1, 0, 0) != order(2, 0, 0)


def test_prefetch_propagates_errors_and_stops_early(tmp_path):
    x, y = read_tensors([_shard(tmp_path / "a.parquet", 40)])
    loader = ShardLoader(x, y, steps_per_epoch=10, seed=0, rank=0, prefetch=2)
    iterator = loader.epoch(0)
    next(iterator)
    iterator.close()  # abandoning an epoch must not leave the producer blocked


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no shard files"):
        read_tensors([])
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet"):
        read_tensors([str(bad)])
    x, y = read_tensors([_shard(tmp_path / "a.parquet", 3)])
    with pytest.raises(DataError, match="fewer than the 5 steps"):
        ShardLoader(x, y, steps_per_epoch=5, seed=0, rank=0)
