"""Parquet files read and written by Spark's Python workers through a pyarrow FileSystem (mapInArrow bodies).

Spark reads object-store URLs only through Hadoop connectors (s3a needs the hadoop-aws jars, which a
cluster may not have and this project cannot fetch); pyarrow reads and writes every store shardline
supports. So where the data is not local, files are listed on the driver and each task reads its files
here, by ranged requests with pre_buffer, or writes its rows as one file here. The filesystem is captured
as a plain picklable value that carries no credentials (pipeline/storage resolves it from the environment
chain); each executor's SDK reads its own.
"""
from __future__ import annotations

import uuid
from typing import Callable, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

WRITTEN_DDL = "path string, rows bigint"


def make_read_fn(filesystem, files: Sequence[tuple[str, dict]], schema: pa.Schema,
                 batch_rows: int = 65_536) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Body over `spark.range(len(files))`: row i reads files[i] = (path, partition values) into `schema`
    (its columns in that order, cast to its types; Hive partition values added as constant columns)."""

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                path, partition = files[index]
                parquet = pq.ParquetFile(filesystem.open_input_file(path), pre_buffer=True)
                stored = [name for name in schema.names if name not in partition]
                # Row group by row group: pre_buffer over the whole file buffers all of it (the audit of
                # issue 47: a 136 MB file took a 172 MB task, 53 MB without pre_buffer); per row group it
                # still coalesces that group's column chunks into few requests.
                for group in range(parquet.num_row_groups):
                    for part in parquet.iter_batches(batch_size=batch_rows, columns=stored, row_groups=[group]):
                        yield _with_partition(part, schema, partition)

    return read


def _with_partition(part: pa.RecordBatch, schema: pa.Schema, partition: dict) -> pa.RecordBatch:
    """`part` in `schema`: its columns cast to the schema's types, Hive partition values as constants."""
    arrays = []
    for field in schema:
        if field.name in partition:
            arrays.append(pa.array([partition[field.name]] * part.num_rows, field.type))
        else:
            column = part.column(field.name)
            arrays.append(column if column.type == field.type else column.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def make_write_fn(filesystem, folder: str,
                  compression: str = "snappy") -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Body writing a task's batches as one Parquet file under `folder`; yields (path, rows). Named by
    partition, attempt and a random id, so a retried or speculative attempt never overwrites another's
    file (the driver keeps only the files successful attempts reported)."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        name = f"part-{context.partitionId():05d}-a{context.attemptNumber()}-{uuid.uuid4().hex[:8]}.parquet"
        path = f"{folder.rstrip('/')}/{name}"
        writer: Optional[pq.ParquetWriter] = None
        rows = 0
        try:
            for batch in batches:
                if writer is None:
                    # The writer opens (and on close completes) the object itself: on S3 a multipart
                    # upload, visible only once whole.
                    writer = pq.ParquetWriter(path, batch.schema, filesystem=filesystem, compression=compression)
                writer.write_batch(batch)
                rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
        yield pa.RecordBatch.from_pylist([{"path": path, "rows": rows}] if writer is not None else [],
                                         schema=pa.schema([("path", pa.string()), ("rows", pa.int64())]))

    return write
