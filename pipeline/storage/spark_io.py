"""Parquet in and out of Spark on any store: Spark's own reader/writer for local paths, pyarrow in the
Python workers (udfs/arrow_files.py) for object-store URLs, which Spark itself reaches only through
Hadoop connectors (s3a needs hadoop-aws jars a cluster may lack)."""
from __future__ import annotations

import logging
import os
import posixpath
import uuid
from typing import Optional, Sequence

from pipeline.errors import DataError
from pipeline.storage import delete_dir, is_remote, resolve, spark_native, url_of, write_bytes

log = logging.getLogger(__name__)

SUCCESS = "_SUCCESS"


def _fragments(urls: Sequence[str]):
    """(filesystem, [(fs path, partition values)], unified Arrow schema) of the Parquet files of `urls`
    (files or folders; Hive key=value folders give partition columns; names starting with . or _ skipped)."""
    import pyarrow.dataset as ds

    fs, _ = resolve(urls[0])
    files, schema = [], None
    for url in urls:
        _, path = resolve(url)
        try:
            dataset = ds.dataset(path, filesystem=fs, format="parquet", partitioning="hive")
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read Parquet at {url}: {exc}; check the URL and the store's credentials "
                            "(taken from the environment: AWS_*, GOOGLE_*, AZURE_*)") from None
        schema = dataset.schema if schema is None else schema
        for fragment in dataset.get_fragments():
            keys = ds.get_partition_keys(fragment.partition_expression) if fragment.partition_expression is not None \
                else {}
            files.append((fragment.path, {k: v for k, v in keys.items()}))
    return fs, files, schema


def read_parquet(spark, urls: Sequence[str] | str, columns: Optional[Sequence[str]] = None):
    """A DataFrame of the Parquet files/folders `urls`: spark.read.parquet for local paths; on an object
    store one task per file, reading it with pyarrow (ranged requests, pre_buffer)."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    if all(spark_native(u) for u in urls):
        df = spark.read.parquet(*urls)
        return df.select(*[f"`{c}`" for c in columns]) if columns else df
    from pyspark.sql.pandas.types import from_arrow_schema

    from udfs.arrow_files import make_read_fn

    fs, files, schema = _fragments(urls)
    if not files:
        raise DataError(f"no Parquet files under {', '.join(urls)}")
    if columns:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise DataError(f"column(s) {missing} are not in the Parquet files at {urls[0]} (it has {schema.names})")
        import pyarrow as pa

        schema = pa.schema([schema.field(c) for c in columns])
    try:
        slots = spark.sparkContext.defaultParallelism
    except Exception:  # Spark Connect has no SparkContext
        slots = 8
    tasks = max(1, min(len(files), slots * 4))
    return spark.range(len(files), numPartitions=tasks).mapInArrow(
        make_read_fn(fs, files, schema), from_arrow_schema(schema))


def write_parquet(df, url: str, overwrite: bool = False) -> int:
    """Write `df` as Parquet to the folder `url`; returns the files written.

    Local: Spark's writer (into a hidden sibling, renamed into place by the caller as before). Object
    stores: each task writes one file into a fresh hidden staging prefix; the driver drops files of failed
    attempts, then copies the reported files into `url` (server-side copies) and writes `_SUCCESS` last,
    the marker Hadoop-style readers wait for: a store without rename cannot swap a folder in at once."""
    from udfs.arrow_files import WRITTEN_DDL, make_write_fn

    fs, target = resolve(url)
    parent, name = posixpath.split(target)
    staging = f"{parent}/.{name}.staging-{uuid.uuid4().hex[:12]}"
    try:
        reported = [r.asDict() for r in df.mapInArrow(make_write_fn(fs, staging), WRITTEN_DDL).collect()]
        if overwrite:
            delete_dir(url)
        for row in reported:
            fs.copy_file(row["path"], f"{target}/{posixpath.basename(row['path'])}")
        write_bytes(url_of(url, f"{target}/{SUCCESS}"), b"")
    finally:
        delete_dir(url_of(url, staging))
    log.info("wrote %d Parquet file(s) (%d rows) to %s", len(reported), sum(r["rows"] for r in reported), url)
    return len(reported)


def local_path(url: str) -> Optional[str]:
    """The local path of `url`, None for a store URL."""
    if is_remote(url):
        return None
    return url[len("file://"):] if url.startswith("file://") else os.fspath(url)
