"""Where `shardline score` writes its predictions (score.output_format), checked before anything is scored.

- parquet: a folder. Spark writes into a hidden sibling that is renamed into place (local and HDFS paths;
  the old output moved aside first with score.overwrite), or, on an object store, pyarrow in the tasks
  writes a staging prefix copied into place with `_SUCCESS` last (pipeline/storage/spark_io.write_parquet).
- delta / iceberg: a table, appended to in one commit with the model's URI and registered version as two
  more columns (pipeline/tables/delta_write.py, iceberg_write.py): the table is checked against the
  predictions' schema here, before the reject pre-pass and the write.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Optional

from pipeline import storage
from pipeline.config.schema import PipelineConfig
from pipeline.errors import ShardlineError

log = logging.getLogger(__name__)

MODEL_COLUMNS = ("model_uri", "model_version")  # what a table output adds to each row


class _FS:
    """Existence, rename and delete for the output: local paths with os, other schemes with Hadoop's FS."""

    def __init__(self, spark, path: str):
        self.local = "://" not in path or path.startswith("file://")
        self.path = path[len("file://"):] if path.startswith("file://") else path
        if not self.local:
            jvm = spark.sparkContext._jvm
            self._Path = jvm.org.apache.hadoop.fs.Path
            self._fs = self._Path(path).getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())

    def sibling(self, prefix: str) -> str:
        parent, name = os.path.split(self.path.rstrip("/"))
        return os.path.join(parent, f".{name}.{prefix}-{uuid.uuid4().hex[:12]}")

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else self._fs.exists(self._Path(path))

    def rename(self, src: str, dst: str) -> None:
        if self.local:
            os.rename(src, dst)
        elif not self._fs.rename(self._Path(src), self._Path(dst)):
            raise ShardlineError(f"could not rename {src} to {dst}")

    def delete(self, path: str) -> None:
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
        else:
            self._fs.delete(self._Path(path), True)


def check_output(spark, cfg: PipelineConfig, output: str) -> Optional[_FS]:
    """Before scoring: a Parquet output that exists is an error unless score.overwrite (returns the Hadoop-side
    handle of a Spark-native path, None for an object store or a table); a table output takes no overwrite."""
    sc = cfg.score
    if sc.output_format != "parquet":
        if sc.overwrite:
            raise ShardlineError(f"score.overwrite=true replaces a Parquet output, but score.output_format="
                                 f"{sc.output_format} appends to the table {output}; set score.overwrite=false")
        return None
    remote = not storage.spark_native(output)
    fs = None if remote else _FS(spark, output)
    if (storage.exists(output) if remote else fs.exists(fs.path)) and not sc.overwrite:
        raise ShardlineError(f"score output {output} exists; remove it or set score.overwrite=true")
    return fs


def write_parquet_output(fs: Optional[_FS], scored, output: str, overwrite: bool) -> None:
    """The predictions as the Parquet folder `output`, whole or not at all (see the module docstring)."""
    if fs is None:
        from pipeline.storage.spark_io import write_parquet

        write_parquet(scored, output, overwrite=overwrite)
        return
    staging = fs.sibling("staging")
    try:
        scored.write.mode("errorifexists").parquet(staging)
        if fs.exists(fs.path):
            if not overwrite:
                raise ShardlineError(f"score output {output} appeared while scoring; the predictions stay "
                                     f"unpublished (set score.overwrite=true)")
            trash = fs.sibling("replaced")
            fs.rename(fs.path, trash)
            fs.rename(staging, fs.path)
            fs.delete(trash)
        else:
            fs.rename(staging, fs.path)
    except BaseException:
        fs.delete(staging)
        raise


def table_target(cfg: PipelineConfig, predictions, model_uri: str, version: str, output: str):
    """(the predictions with the model columns, the writer module, its checked target) of a table output;
    a TableError, before anything is written, where the table cannot take them."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema

    # The registered version, or null where the URI names a run or a logged model (no registry entry).
    predictions = predictions.withColumns({MODEL_COLUMNS[0]: F.lit(model_uri),
                                           MODEL_COLUMNS[1]: F.lit(version or None).cast("string")})
    schema = to_arrow_schema(predictions.schema)
    if cfg.score.output_format == "delta":
        from pipeline.tables import delta_write

        return predictions, delta_write, delta_write.prepare(output, schema)
    from pipeline.tables import iceberg_write

    return predictions, iceberg_write, iceberg_write.prepare(cfg.data.iceberg, output, schema)
