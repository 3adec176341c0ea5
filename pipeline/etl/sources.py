"""Sources: every dataset enters as a Spark DataFrame read from files (CSV or Parquet).

The built-in sources (`digits`, `digits_images`, `synthetic`, `clicks`) are first landed as raw Parquet,
then read back like any other source, so the demo and the benchmarks exercise the same path as
production data.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from pipeline.config.schema import DataConfig
# The digits landers live in digits.py; their names stay importable from here.
from pipeline.etl.digits import (DIGITS_ID, digits_images_raw_path, digits_raw_path, land_digits,  # noqa: F401
                                 land_digits_images)
from pipeline.errors import DataError

log = logging.getLogger(__name__)


def builtin_id_column(source: str) -> Optional[str]:
    """The id column a built-in source lands (its rows' split key when data.id_column is null)."""
    from pipeline.etl.clicks import CLICKS_ID
    from pipeline.etl.synthetic import SYNTHETIC_ID

    return {"digits": DIGITS_ID, "digits_images": DIGITS_ID, "synthetic": SYNTHETIC_ID,
            "clicks": CLICKS_ID}.get(source)


def _hidden(name: str) -> bool:
    """Names Spark's file index skips: _SUCCESS, _metadata, .crc files, in-progress copies."""
    return (name.startswith("_") and "=" not in name) or name.startswith(".") or name.endswith("._COPYING_")


def data_files(path: Path) -> list[Path]:
    """The files Spark reads for `path` (a file, or every visible file below a folder), sorted."""
    if path.is_file():
        return [path]
    found = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        found.extend(Path(folder) / n for n in sorted(names) if not _hidden(n))
    return found


def _kind(arrow_type) -> str:
    """A type family: files whose columns differ only within a family (int32/int64, float/double) are
    read by Spark; a column that is text in one file and a number in another is not."""
    import pyarrow as pa

    t = arrow_type.value_type if pa.types.is_dictionary(arrow_type) else arrow_type
    for family, test in (("integer", pa.types.is_integer), ("floating", pa.types.is_floating),
                         ("text", lambda x: pa.types.is_string(x) or pa.types.is_large_string(x)),
                         ("binary", lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x)),
                         ("boolean", pa.types.is_boolean), ("decimal", pa.types.is_decimal)):
        if test(t):
            return family
    return str(t)


def _footer_schema(file: Path):
    """The file's Arrow schema from its Parquet footer, or the reason it cannot be read."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(file).schema.to_arrow_schema(), None
    except Exception as exc:  # ArrowInvalid, OSError: not Parquet, truncated, unreadable
        return None, f"{type(exc).__name__}: {exc}"


def check_parquet_files(path: Path, data: DataConfig) -> None:
    """Read every file's footer (metadata only, no data) before Spark does, so a corrupt file or one whose
    schema differs from the others is an error naming the file and the column instead of a Spark stack
    trace or (a missing column) silently null values."""
    files = data_files(path)
    if not files:
        raise DataError(f"data.path {str(path)!r} holds no Parquet files (data.source=parquet); point data.path "
                        "at a Parquet file or a folder of them")
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        footers = list(pool.map(_footer_schema, files))
    broken = [(f, why) for f, (_, why) in zip(files, footers) if why]
    if broken:
        listed = "; ".join(f"{f} ({why})" for f, why in broken[:3])
        more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
        raise DataError(f"{len(broken)} of {len(files)} file(s) under data.path={path} are not readable Parquet "
                        f"(corrupt or truncated): {listed}{more}; replace or remove them and re-run the ETL")
    root = path if path.is_dir() else path.parent
    # Partition folders (key=value) supply their column from the path, not the file.
    partition_columns = {part.split("=", 1)[0] for f in files for part in f.relative_to(root).parts[:-1]
                         if "=" in part}
    schemas = [schema for schema, _ in footers]
    names: list[str] = list(dict.fromkeys(n for schema in schemas for n in schema.names))
    if data.features is not None:
        wanted = [n for n in data.feature_names + [data.label] + ([data.id_column] if data.id_column else [])]
        names = [n for n in dict.fromkeys(wanted) if n in names]
    for name in names:
        if name in partition_columns:
            continue
        missing = [f for f, schema in zip(files, schemas) if name not in schema.names]
        if missing:
            having = next(f for f, schema in zip(files, schemas) if name in schema.names)
            raise DataError(
                f"column {name!r} is missing from {len(missing)} of {len(files)} Parquet file(s) under "
                f"data.path={path}, e.g. {missing[0]} (it is in {having}); Spark would read it as null there. "
                "Rewrite or remove the files with the other schema"
                + ("" if data.features is not None else ", or list the columns you use in data.features"))
        kinds: dict[str, list[Path]] = {}
        types: dict[Path, str] = {}
        for f, schema in zip(files, schemas):
            arrow_type = schema.field(name).type
            kinds.setdefault(_kind(arrow_type), []).append(f)
            types[f] = str(arrow_type)
        if len(kinds) > 1:
            usual = max(kinds.values(), key=len)  # the majority's type; ties: the first file's
            odd = next(f for f in files if f not in usual)
            raise DataError(
                f"column {name!r} has type {types[odd]} in {odd} but {types[usual[0]]} in {usual[0]} "
                f"({len(files) - len(usual)} of {len(files)} Parquet file(s) under data.path={path} differ); "
                "rewrite or remove the files with the other schema so every file has the same column types")


def _local_path(path: str) -> Optional[Path]:
    if path.startswith("file://"):
        return Path(path[len("file://"):])
    return None if "://" in path else Path(path)


def _read_table(spark, name: str):
    """A catalog table or view (Unity Catalog, Hive metastore, a temp view) by name."""
    try:
        return spark.table(name)
    except Exception as exc:  # AnalysisException (classic) / its Connect twin: the name resolves to nothing
        if "TABLE_OR_VIEW_NOT_FOUND" in str(exc) or "not found" in str(exc).lower():
            raise DataError(f"data.path {name!r} names no table or view (data.source=table); create it, or "
                            "give its full name (catalog.schema.table)") from None
        raise


def read_source(spark, data: DataConfig, workdir: str, pinned=None):
    """The configured source as a DataFrame; a missing path is an error naming it and the config key.
    A Delta/Iceberg source is read at `pinned` (pipeline.etl.pinning.pin_source), else pinned here."""
    if data.source in ("delta", "iceberg"):
        from pipeline.tables.read import pin, table_frame

        pinned = pinned or pin(data)
        wanted = None
        if data.features is not None:
            wanted = data.feature_names + [data.label] + ([data.id_column] if data.id_column else [])
        return table_frame(spark, pinned, wanted)
    if data.source == "digits":
        path = land_digits(digits_raw_path(data, workdir))
        return spark.read.parquet(str(path))
    if data.source == "digits_images":
        return spark.read.parquet(str(land_digits_images(digits_images_raw_path(data, workdir))))
    if data.source == "synthetic":
        from pipeline.etl.synthetic import generate

        return spark.read.parquet(str(generate(spark, data, workdir)))
    if data.source == "clicks":
        from pipeline.etl.clicks import generate_clicks

        return spark.read.parquet(str(generate_clicks(spark, data, workdir)))
    path = data.path
    if data.source == "table":
        return _read_table(spark, path)
    if "://" not in path and not Path(path).exists():
        raise DataError(f"data.path {path!r} does not exist (data.source={data.source}); "
                        "point data.path at the input file or folder")
    if data.source == "csv":
        # enforceSchema=false: every file's header must match the first one's (Spark otherwise maps the
        # columns of a file with another header by position, silently); the options may override it.
        return spark.read.option("enforceSchema", "false").options(**data.csv_options).csv(path)
    local = _local_path(path)
    if local is not None:
        check_parquet_files(local, data)
        return spark.read.parquet(path)
    from pipeline.storage import spark_native

    if spark_native(path):  # hdfs://, dbfs:/...: Spark reads them itself
        return spark.read.parquet(path)
    from pipeline.storage.spark_io import read_parquet

    return read_parquet(spark, path)
