"""The rows a Spark task names by (file, row index), read from their Parquet file with pyarrow (executor side).

Pass 1 of the typed ETL (pipeline/etl/direct_read.py) hands its tasks three columns per row: the Parquet
file, the row's index in that file and its split. This module reads each named run of rows from the file,
casts every column to the Arrow type Spark's own conversion would have produced (the driver chose only
conversions pyarrow makes exactly as Spark does), and yields record batches shaped as the Spark path's:
the feature and label columns, then the split. Spark reads a file's row groups in order, so a task's rows
are consecutive runs and the reader keeps one cursor per file instead of seeking for every batch.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FILE_COLUMN = "__file"
ROW_COLUMN = "__row"
READ_BATCH_ROWS = 65_536


def local_path(uri: str) -> str:
    """Spark's `_metadata.file_path` (file:/a%20b/part-0.parquet) as the local path pyarrow opens."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise ValueError(f"{uri} is not a local file: the direct Parquet read takes file: paths only")
    return unquote(parsed.path)


class _FileCursor:
    """One Parquet file read forward from a row, in READ_BATCH_ROWS record batches of the wanted columns."""

    def __init__(self, path: str, columns: Sequence[tuple[str, pa.DataType]]):
        import pyarrow.parquet as pq

        self.path = path
        self.file = pq.ParquetFile(path)
        present = {name.lower(): name for name in self.file.schema_arrow.names}
        # Spark matches columns case-insensitively (spark.sql.caseSensitive=false); a column missing from
        # this file (a schema that grew) is null in Spark's rows, so it is null here.
        self.names = {name: (name if name in self.file.schema_arrow.names else present.get(name.lower()))
                      for name, _ in columns}
        self.types = dict(columns)
        self.wanted = sorted({n for n in self.names.values() if n is not None})
        self.starts = np.cumsum([0] + [self.file.metadata.row_group(i).num_rows
                                       for i in range(self.file.metadata.num_row_groups)])
        self.position, self.batches, self.pending = -1, iter(()), None

    def _seek(self, row: int) -> None:
        group = int(np.searchsorted(self.starts, row, side="right")) - 1
        if group < 0 or row >= self.starts[-1]:
            raise ValueError(f"{self.path} has {int(self.starts[-1])} rows; Spark named row {row}")
        self.batches = self.file.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=range(group, len(self.starts) - 1),
                                              columns=self.wanted, use_threads=False)
        self.pending = None
        self.position = int(self.starts[group])
        self._take(row - self.position)

    def _take(self, count: int) -> list[pa.Table]:
        """The next `count` rows from the cursor, as zero-copy slices of the decoded batches."""
        parts = []
        while count:
            if self.pending is None or not self.pending.num_rows:
                self.pending = pa.Table.from_batches([next(self.batches)])
            n = min(count, self.pending.num_rows)
            parts.append(self.pending.slice(0, n))
            self.pending = self.pending.slice(n)
            self.position += n
            count -= n
        return parts

    def read(self, start: int, count: int) -> pa.Table:
        """Rows [start, start + count) of the file, as a table of the wanted columns (named as Spark names them)."""
        if start != self.position:
            self._seek(start)
        parts = self._take(count)
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        arrays = []
        for name, source in self.names.items():
            target = self.types[name]
            if source is None:
                arrays.append(pa.nulls(count, target))
                continue
            column = table.column(source)
            arrays.append(column if column.type == target else column.cast(target, safe=False))
        return pa.table(arrays, names=list(self.names))


class ParquetRows:
    """Turns Spark's (file, row index, split) batches into batches of the named rows' columns plus the split."""

    def __init__(self, columns: Sequence[tuple[str, pa.DataType]], split_column: str):
        self.columns = list(columns)
        self.split_column = split_column
        self.cursor: Optional[_FileCursor] = None

    def _cursor(self, uri: str) -> _FileCursor:
        path = local_path(uri)
        if self.cursor is None or self.cursor.path != path:
            self.cursor = _FileCursor(path, self.columns)
        return self.cursor

    def _run(self, uri: str, index: np.ndarray, split: pa.Array) -> pa.RecordBatch:
        first, last = int(index[0]), int(index[-1])
        consecutive = last - first + 1 == len(index) and bool((np.diff(index) == 1).all())
        if consecutive:
            table = self._cursor(uri).read(first, len(index))
        else:  # not seen from a plain scan, but a filtered one would name rows so: read the span, take them
            table = self._cursor(uri).read(first, last - first + 1).take(pa.array(index - first))
        (rows,) = table.combine_chunks().to_batches()  # a run holds at least one row: one batch
        return pa.RecordBatch.from_arrays(rows.columns + [split], names=rows.schema.names + [self.split_column])

    def batches(self, named: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in named:
            if not batch.num_rows:
                continue
            files = batch.column(FILE_COLUMN)
            index = batch.column(ROW_COLUMN).to_numpy(zero_copy_only=False)
            split = batch.column(self.split_column)
            if files.null_count:
                raise ValueError("Spark named a row without its Parquet file (_metadata.file_path is null)")
            first = files[0].as_py()
            if pc.all(pc.equal(files, first)).as_py():  # the usual batch: one file (no dictionary of paths)
                yield self._run(first, index, split)
                continue
            codes = pc.dictionary_encode(files)
            ids = codes.indices.to_numpy(zero_copy_only=False)
            bounds = np.flatnonzero(np.diff(ids)) + 1
            for start, stop in zip(np.r_[0, bounds], np.r_[bounds, len(ids)]):
                yield self._run(codes.dictionary[ids[start]].as_py(), index[start:stop],
                                split.slice(start, stop - start))


def reading_named_rows(columns: Sequence[tuple[str, pa.DataType]], split_column: str,
                       consumer: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]):
    """A mapInArrow function: `consumer` (the encode pass) fed the named rows' batches instead of Spark's."""

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from consumer(ParquetRows(columns, split_column).batches(batches))

    return read
