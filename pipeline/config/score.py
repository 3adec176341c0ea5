"""``score``: batch inference with a tracked model (`shardline score`), validated at construction."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.section import Section


class ScoreConfig(Section):
    """`shardline score`: batch inference with a tracked model on a Parquet path or a table."""

    # Rows with a null/NaN/inf (or non-numeric) feature: drop (counted per column, not written),
    # reject (fail before anything is written, naming the columns and counts), or keep_null (written
    # with a null prediction/probability and counted).
    invalid_rows: Literal["drop", "reject", "keep_null"] = "drop"
    # Input columns copied unchanged into the output next to the predictions (ids, keys).
    keep_columns: list[str] = Field(default_factory=list)
    # Replace an existing output (atomically, by rename); false: an existing output is an error.
    overwrite: bool = False
    # Rows per model forward pass inside each Arrow batch.
    batch_size: int = Field(8192, ge=1)
    # torch intra-op threads per Python worker (Spark runs one worker per task slot).
    threads_per_worker: int = Field(1, ge=1, le=256)
    # classification: also write the class probabilities as an array<float> column `probability`.
    probabilities: bool = True
    # The output: a Parquet folder, or a Delta table (its folder or URL) / an Iceberg table (namespace.table
    # in the catalog data.iceberg) that the scores are appended to in one commit, with the model's URI and
    # version as columns (needs shardline[delta] / shardline[iceberg]).
    output_format: Literal["parquet", "delta", "iceberg"] = "parquet"
    # Log the counts and throughput as a new MLflow run in tracking.experiment.
    log_to_mlflow: bool = False
