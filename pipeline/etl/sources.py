"""Sources: every dataset enters as a Spark DataFrame read from files (CSV or Parquet).

The built-in `digits` and `synthetic` sources are first landed as raw Parquet, then read back like any
other source, so the demo and the benchmarks exercise the same path as production data.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from pipeline.config.schema import DataConfig
from pipeline.errors import DataError

log = logging.getLogger(__name__)

DIGITS_ID = "image_id"


def digits_raw_path(data: DataConfig, workdir: str) -> Path:
    return Path(data.path) if data.path else Path(workdir) / "raw" / "digits"


def land_digits(target: Path) -> Path:
    """Write scikit-learn's handwritten digits (1,797 8x8 images) as raw Parquet, atomically, once."""
    if (target / "_SUCCESS").exists():
        return target
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = digits.data.astype(np.float64)
    columns = {DIGITS_ID: pa.array(np.arange(len(pixels), dtype=np.int64))}
    columns.update({f"pixel_{i:02d}": pa.array(pixels[:, i]) for i in range(pixels.shape[1])})
    columns["label"] = pa.array(digits.target.astype(np.int64))
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        pq.write_table(pa.table(columns), staging / "part-00000.parquet")
        (staging / "_SUCCESS").touch()
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("landed %d digits images as raw Parquet in %s", len(pixels), target)
    return target


def read_source(spark, data: DataConfig, workdir: str):
    """The configured source as a DataFrame; a missing path is an error naming it and the config key."""
    if data.source == "digits":
        path = land_digits(digits_raw_path(data, workdir))
        return spark.read.parquet(str(path))
    if data.source == "synthetic":
        from pipeline.etl.synthetic import generate

        return spark.read.parquet(str(generate(spark, data, workdir)))
    path = data.path
    if "://" not in path and not Path(path).exists():
        raise DataError(f"data.path {path!r} does not exist (data.source={data.source}); "
                        "point data.path at the input file or folder")
    if data.source == "csv":
        return spark.read.options(**data.csv_options).csv(path)
    return spark.read.parquet(path)
