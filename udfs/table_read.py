"""The files of a pinned Delta or Iceberg table read by Spark's Python workers (mapInArrow bodies over
`spark.range(tasks)`: row i reads the i-th group of files). The driver planned the read (pipeline/tables):
these only apply it, so every task reads the same pinned version.

Delta: the files' physical columns renamed to the logical names (column mapping), the rows of the file's
deletion vector dropped, partition values added as typed constant columns. Iceberg: pyiceberg's ArrowScan
over the task's FileScanTasks (field ids, positional deletes).
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import pyarrow as pa

_BATCH_ROWS = 65_536


def make_delta_read_fn(filesystems: Sequence, groups: Sequence[Sequence], schema: pa.Schema,
                       physical: dict) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """`groups[i]`: (file system index, fs path, partition values, deleted row indexes) of task i's files."""

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import numpy as np
        import pyarrow.parquet as pq

        for batch in batches:
            for index in batch.column(0).to_pylist():
                for fs_index, path, partition, deleted in groups[index]:
                    parquet = pq.ParquetFile(filesystems[fs_index].open_input_file(path))
                    # A column added to the table after this file was written is not in it: null here.
                    present = set(parquet.schema_arrow.names)
                    stored = [f.name for f in schema
                              if f.name not in partition and physical.get(f.name, f.name) in present]
                    columns = [physical.get(name, name) for name in stored]
                    dropped = np.asarray(deleted, dtype=np.int64)
                    start = 0
                    for group in range(parquet.num_row_groups):
                        for part in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=columns, row_groups=[group]):
                            rows = part.num_rows
                            if dropped.size:
                                inside = dropped[(dropped >= start) & (dropped < start + rows)] - start
                                if inside.size:
                                    keep = np.ones(rows, dtype=bool)
                                    keep[inside] = False
                                    part = part.filter(pa.array(keep))
                            start += rows
                            if part.num_rows:
                                yield _typed(part, stored, schema, partition)

    return read


def _typed(part: pa.RecordBatch, stored: list, schema: pa.Schema, partition: dict) -> pa.RecordBatch:
    arrays, position = [], {name: i for i, name in enumerate(stored)}
    for field in schema:
        if field.name in partition:
            arrays.append(pa.array([partition[field.name]] * part.num_rows, field.type))
        elif field.name not in position:
            arrays.append(pa.nulls(part.num_rows, field.type))
        else:
            column = part.column(position[field.name])
            arrays.append(column if column.type == field.type else column.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def make_iceberg_read_fn(metadata, io, projection, groups: Sequence[Sequence],
                         schema: pa.Schema) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """`groups[i]`: task i's pyiceberg FileScanTasks; `projection`: the scan's Iceberg schema."""

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.io.pyarrow import ArrowScan

        scan = ArrowScan(metadata, io, projection, AlwaysTrue())
        for batch in batches:
            for index in batch.column(0).to_pylist():
                for part in scan.to_record_batches(groups[index]):
                    if part.num_rows:
                        yield pa.RecordBatch.from_arrays(
                            [part.column(f.name).cast(f.type) for f in schema], schema=schema)

    return read
