import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data import read_tensors
from pipeline.errors import DataError

pytestmark = pytest.mark.lts  # also run on the LTS stack


def _shard(path, rows, width=4, start=0):
    values = np.arange(start, start + rows, dtype=np.float32).repeat(width).reshape(rows, width)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32)),
                                        pa.array(values.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": pa.array(np.arange(start, start + rows))}), path)
    return str(path)


def test_read_tensors_concatenates_files(tmp_path):
    files = [_shard(tmp_path / "a.parquet", 5), _shard(tmp_path / "b.parquet", 3, start=5)]
    x, y = read_tensors(files)
    assert set(x) == {"numeric"}
    x = x["numeric"]
    assert x.shape == (8, 4) and x.dtype == torch.float32
    assert y.tolist() == list(range(8)) and y.dtype == torch.int64
    assert torch.equal(x[:, 0], y.float())


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no shard files"):
        read_tensors([])
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet"):
        read_tensors([str(bad)])


def test_read_tensors_reads_only_the_rows_asked_for(tmp_path):
    files = []
    for i, (rows, start) in enumerate(((5, 0), (7, 5), (4, 12))):
        path = tmp_path / f"{i}.parquet"
        _shard(path, rows, start=start)
        table = pq.read_table(path)
        pq.write_table(table, path, row_group_size=3)  # row groups cut inside and across files
        files.append(str(path))
    everything = list(range(16))
    for start, stop in ((0, 16), (0, 1), (2, 9), (4, 5), (5, 12), (13, 16), (6, 7)):
        x, y = read_tensors(files, rows=(start, stop))
        assert y.tolist() == everything[start:stop]
        assert torch.equal(x["numeric"][:, 0], y.float())
    with pytest.raises(DataError, match=r"the 3 shard file\(s\) hold 16 rows, none of rows 16\.\.20"):
        read_tensors(files, rows=(16, 20))
