"""udfs/parquet_rows.py without Spark: the rows named by (file URI, row index) come back exactly, cast, in the
order named, across row groups, files, jumps and gaps; a bad name fails naming the file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from udfs.parquet_rows import FILE_COLUMN, ROW_COLUMN, ParquetRows, local_path, reading_named_rows

pytestmark = pytest.mark.lts  # pyarrow 14 too

COLUMNS = [("n", pa.float64()), ("flag", pa.string()), ("city", pa.string()), ("vec", pa.list_(pa.float64())),
           ("absent", pa.int64())]


def _file(path: Path, rows: int, offset: int) -> pa.Table:
    index = np.arange(offset, offset + rows)
    table = pa.table({"n": pa.array(index, pa.int32()), "flag": pa.array(index % 3 == 0),
                      "city": pa.array([None if i % 7 == 0 else f"c{i % 5}" for i in index]),
                      "vec": pa.array([[float(i), 0.5] for i in index], pa.list_(pa.float32())),
                      "ignored": index})
    pq.write_table(table, path, row_group_size=40)
    return table


def _expected(table: pa.Table, index) -> dict:
    rows = table.take(pa.array(index))
    return {"n": rows.column("n").cast(pa.float64()).to_pylist(),
            "flag": rows.column("flag").cast(pa.string()).to_pylist(),
            "city": rows.column("city").to_pylist(),
            "vec": rows.column("vec").cast(pa.list_(pa.float64())).to_pylist(),
            "absent": [None] * len(index)}


def _named(parts) -> pa.RecordBatch:
    files, rows, splits = [], [], []
    for uri, index in parts:
        files += [uri] * len(index)
        rows += list(index)
        splits += ["train" if i % 2 else "test" for i in index]
    return pa.RecordBatch.from_pydict({FILE_COLUMN: files, ROW_COLUMN: pa.array(rows, pa.int64()), "__split": splits})


@pytest.fixture
def two_files(tmp_path):
    a, b = tmp_path / "a b.parquet", tmp_path / "b.parquet"  # a space: Spark's URIs escape it
    return (a.as_uri(), _file(a, 150, 0)), (b.as_uri(), _file(b, 90, 1000))


def test_named_rows_come_back_cast_in_order_across_row_groups_files_jumps_and_gaps(two_files):
    (ua, ta), (ub, tb) = two_files
    batches = [
        _named([(ua, range(0, 55))]),                        # crosses the first row group's end
        _named([(ua, range(55, 150)), (ub, range(0, 30))]),  # one batch ending a file and starting the next
        _named([(ub, range(30, 90))]),
        _named([(ua, range(120, 130))]),                     # back into a file already read: a new cursor
        _named([(ua, [3, 4, 9, 81])]),                       # gaps: the span is read, the rows taken
    ]
    out = list(ParquetRows(COLUMNS, "__split").batches(iter(batches)))
    got = {name: sum((b.column(name).to_pylist() for b in out), []) for name, _ in COLUMNS}
    tables = {ua: ta, ub: tb}
    expected = {name: [] for name, _ in COLUMNS}
    for batch in batches:
        for uri, index in _runs(batch):
            for name, values in _expected(tables[uri], index).items():
                expected[name] += values
    assert got == expected
    assert all(b.schema.names == [n for n, _ in COLUMNS] + ["__split"] for b in out)
    assert all(b.schema.field(n).type == t for b in out for n, t in COLUMNS)
    assert sum((b.column("__split").to_pylist() for b in out), []) == \
        sum((b.column("__split").to_pylist() for b in batches), [])


def _runs(batch):
    files = batch.column(FILE_COLUMN).to_pylist()
    rows = batch.column(ROW_COLUMN).to_pylist()
    runs = []
    for f, r in zip(files, rows):
        if runs and runs[-1][0] == f:
            runs[-1][1].append(r)
        else:
            runs.append((f, [r]))
    return runs


def test_the_reader_is_a_map_in_arrow_function_feeding_its_consumer(two_files):
    (ua, ta), _ = two_files
    seen = []

    def consumer(batches):
        for b in batches:
            seen.append(b.num_rows)
        yield pa.RecordBatch.from_pydict({"rows": [sum(seen)]})

    out = list(reading_named_rows(COLUMNS, "__split", consumer)(iter([_named([(ua, range(0, 77))]),
                                                                      _named([(ua, range(77, 150))])])))
    assert seen == [77, 73] and out[0].column("rows").to_pylist() == [150]


def test_a_row_past_the_file_and_a_remote_uri_fail_naming_them(two_files):
    (ua, _), _ = two_files
    with pytest.raises(ValueError, match=r"a b\.parquet has 150 rows; Spark named row 150"):
        list(ParquetRows(COLUMNS, "__split").batches(iter([_named([(ua, [150])])])))
    with pytest.raises(ValueError, match="s3a://bucket/x.parquet is not a local file"):
        local_path("s3a://bucket/x.parquet")
    assert local_path("file:/tmp/a%20b/part-0.parquet") == "/tmp/a b/part-0.parquet"
