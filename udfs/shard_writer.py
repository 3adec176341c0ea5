"""Write packed rows straight to Parquet from the Spark task that packed them, one file set per task.

The body runs under `DataFrame.mapInArrow` and returns one small row per file written (its path and
row-group sizes), never the data: no Arrow->JVM round trip, no sort or shuffle before the write, and
exact row groups on every pyarrow version. Files are named by partition and task attempt, so a retried
or speculative attempt never overwrites another's file; the driver keeps only the files that the
successful attempts reported and deletes the rest before it commits (see pipeline/shards/write.py).

Object stores (a `filesystem` other than the local one): each file is streamed straight to the store
through pyarrow's filesystem from the task that packed it, not written to executor scratch and uploaded
after. pyarrow's S3 output stream uploads parts as they fill (memory stays at a part, not a file) and the
object becomes visible only when the writer closes it, so a killed task leaves no partial object (at
most an unfinished multipart upload, which a bucket lifecycle rule aborts); a scratch copy would cost a
second pass over the bytes and executor disk for nothing.
"""
from __future__ import annotations

import os
import uuid
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from udfs.pack import SHARD, SPLIT

FILES_SCHEMA_DDL = "split string, shard int, path string, rows bigint, row_groups array<bigint>"


def _files_schema() -> pa.Schema:
    return pa.schema([("split", pa.string()), ("shard", pa.int32()), ("path", pa.string()),
                      ("rows", pa.int64()), ("row_groups", pa.list_(pa.int64()))])


class _GroupWriter:
    """Rows of one (split, shard) from one task: buffered to whole row groups, rolled over into a new
    file every rows_per_file rows."""

    def __init__(self, root: str, split: str, shard: int, prefix: str, schema: pa.Schema,
                 rows_per_row_group: int, rows_per_file: int, filesystem=None):
        self.folder = f"{root.rstrip('/')}/split={split}/shard={shard}"
        self.filesystem = filesystem  # None: the local filesystem
        self.split, self.shard, self.prefix, self.schema = split, shard, prefix, schema
        self.rows_per_row_group, self.rows_per_file = rows_per_row_group, rows_per_file
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.writer = None
        self.path = ""
        self.file_rows = 0
        self.groups: list[int] = []
        self.sequence = 0
        self.finished: list[dict] = []

    def add(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.pending_rows += batch.num_rows
        while self.pending_rows >= self._next_group_rows():
            self._write_group(self._next_group_rows())

    def close(self) -> list[dict]:
        while self.pending_rows:
            self._write_group(min(self.pending_rows, self._next_group_rows()))
        self._close_file()
        return self.finished

    def _next_group_rows(self) -> int:
        # A group never straddles files, so every file ends on a whole row group.
        return min(self.rows_per_row_group, self.rows_per_file - self.file_rows)

    def _write_group(self, rows: int) -> None:
        table = pa.Table.from_batches(self.pending, schema=self.schema)
        group, rest = table.slice(0, rows), table.slice(rows)
        if self.writer is None:
            if self.filesystem is None:
                os.makedirs(self.folder, exist_ok=True)
            self.path = f"{self.folder}/{self.prefix}-{self.sequence:04d}.parquet"
            # store_schema=False: without the Arrow schema in the footer, readers see the fixed_size_list as
            # the plain Parquet LIST it is stored as (petastorm cannot read fixed-size lists; shardline's
            # loader reads either zero-copy, the manifest holds the width).
            self.writer = pq.ParquetWriter(self.path, self.schema, compression="snappy", store_schema=False,
                                           filesystem=self.filesystem)
            self.sequence += 1
        self.writer.write_table(group, row_group_size=rows)
        self.groups.append(rows)
        self.file_rows += rows
        self.pending = rest.to_batches()
        self.pending_rows = rest.num_rows
        if self.file_rows >= self.rows_per_file:
            self._close_file()

    def _close_file(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        self.finished.append({"split": self.split, "shard": self.shard, "path": self.path,
                              "rows": self.file_rows, "row_groups": list(self.groups)})
        self.writer, self.file_rows, self.groups = None, 0, []


def make_write_fn(
    pack: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
    root: str,
    rows_per_row_group: int,
    rows_per_file: int,
    filesystem=None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Build the mapInArrow body: pack each input batch, route its rows to their (split, shard) files.
    `filesystem`: a pyarrow FileSystem `root` is a path in (None: local paths)."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import numpy as np
        from pyspark import TaskContext

        context = TaskContext.get()
        prefix = f"part-{context.partitionId():05d}-a{context.attemptNumber()}-{uuid.uuid4().hex[:8]}"
        writers: dict[tuple[str, int], _GroupWriter] = {}
        for packed in pack(batches):
            # Every packed column but the routing ones: the numeric block, the typed features, the label.
            kept = [name for name in packed.schema.names if name not in (SPLIT, SHARD)]
            data = pa.RecordBatch.from_arrays([packed.column(name) for name in kept], names=kept)
            splits = packed.column(SPLIT).to_numpy(zero_copy_only=False)
            shards = packed.column(SHARD).to_numpy(zero_copy_only=False)
            keys = np.char.add(splits.astype(str), np.char.add("/", shards.astype(str)))
            for key in np.unique(keys):
                split, shard = str(key).rsplit("/", 1)
                rows = np.flatnonzero(keys == key)
                writer = writers.get((split, int(shard)))
                if writer is None:
                    writer = writers[(split, int(shard))] = _GroupWriter(
                        root, split, int(shard), prefix, data.schema, rows_per_row_group, rows_per_file, filesystem)
                writer.add(data.take(pa.array(rows)))
        files = [f for key in sorted(writers) for f in writers[key].close()]
        yield pa.RecordBatch.from_pylist(files, schema=_files_schema())

    return write
