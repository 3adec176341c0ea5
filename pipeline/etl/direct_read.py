"""Pass 1 of the typed ETL reading a Parquet source's columns with pyarrow instead of through Spark's rows.

Why: for the click log of bench/categorical_etl_bench.py (5M rows, 26 string columns), Spark decoding the
strings from Parquet and converting them row by row to Arrow for `mapInArrow` cost 45-56 CPU s, more than
the whole numeric-only ETL; pyarrow decodes the same columns straight from the files in a few seconds.
Spark still plans the pass (its file splits are the tasks), assigns each row's split from the id column
(pipeline/etl/split.py's xxhash64, as on every other path) and names each row by file and row index
(the Parquet scan's `_metadata`); each task reads exactly those rows with pyarrow (udfs/parquet_rows.py),
cast as pipeline/etl/typed.cast_columns casts them, and the encode pass runs on them unchanged.

Taken only where the result is the Spark path's, row for row: a plain Parquet scan (optionally a column
selection) of file: paths, an id column for the split (without one the split hashes every column, which
Spark would read anyway), no feature from a partition directory, and every column's conversion one that
pyarrow makes as Spark does (CONVERSIONS). Anything else keeps the Spark path; the log says which and why.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

# (the source column's type, the type cast_columns makes of it) pairs pyarrow converts as Spark does, in
# Spark's own names (DataType.simpleString, as cast_columns records the source's). Strings read as numbers
# (Spark's try_cast parses text its own way) and decimals, dates, timestamps and maps are absent: they
# keep the Spark path.
_ATOMS = ("tinyint", "smallint", "int", "bigint", "float", "double", "boolean", "string", "binary")
_NUMBERS = ("tinyint", "smallint", "int", "bigint", "float", "double", "boolean")
CONVERSIONS = frozenset({(a, a) for a in _ATOMS} | {(a, "double") for a in _NUMBERS} | {("boolean", "string")}
                        | {(f"array<{a}>", "array<double>") for a in _NUMBERS[:-1]}
                        | {(f"array<{a}>", f"array<{a}>") for a in _ATOMS[:-1]})


@dataclass(frozen=True)
class DirectSource:
    """What pass 1 runs over instead of the cast source: `frame` names each row (file, row index, split);
    `columns` are the (name, Arrow type) pairs its tasks read, in the Spark path's order."""
    frame: object
    columns: tuple


def _scan_problem(df) -> Optional[str]:
    """Why `df` is not a plain Parquet scan of file: paths (None when it is)."""
    try:
        plan = df._jdf.queryExecution().analyzed()
    except Exception:  # Spark Connect: no JVM plan here, and the executors may be anywhere
        return "the session has no local JVM plan (Spark Connect)"
    if plan.getClass().getSimpleName() == "Project":
        items = plan.projectList()
        if any(items.apply(i).getClass().getSimpleName() != "AttributeReference" for i in range(items.size())):
            return "the source is a query, not a plain file scan"
        plan = plan.child()
    if plan.getClass().getSimpleName() != "LogicalRelation":
        return "the source is a query, not a plain file scan"
    try:
        relation = plan.relation()
        file_format = relation.fileFormat().getClass().getSimpleName()
        partition_columns = set(relation.partitionSchema().fieldNames())
    except Exception:
        return "the source is not a file relation"
    if file_format != "ParquetFileFormat":
        return f"the source is read by {file_format}, not Parquet"
    if partition_columns & set(df.columns):
        return f"columns {sorted(partition_columns & set(df.columns))} come from partition directories"
    files = df.inputFiles()
    if not files or any(not f.startswith("file:") for f in files):
        return "the source's files are not on file: paths"
    return None


def direct_source(selected, cast_df, names: list[str], id_column: Optional[str], split) -> Optional[DirectSource]:
    """The direct read of `names` (the features and the label) for pass 1, or None (logged) for the Spark path.
    `selected`: the source's selected columns; `cast_df`: cast_columns' frame of them."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_type

    from pipeline.etl.split import SPLIT_COLUMN, assign_split
    from udfs.parquet_rows import FILE_COLUMN, ROW_COLUMN

    problem = None if id_column else "no data.id_column: the split hashes every column, which Spark reads"
    problem = problem or _scan_problem(selected)
    if problem is None:
        raw = {f.name: f.dataType.simpleString() for f in selected.schema.fields}
        cast = {f.name: f.dataType for f in cast_df.schema.fields}
        pairs = {n: (raw[n], cast[n].simpleString()) for n in names}
        odd = [f"{n} ({a} -> {b})" for n, (a, b) in pairs.items() if (a, b) not in CONVERSIONS or "." in n]
        problem = f"columns {odd} need Spark's own conversion" if odd else None
    if problem is not None:
        log.info("typed ETL pass 1 reads the source through Spark: %s", problem)
        return None
    columns = tuple((n, to_arrow_type(cast[n])) for n in names)
    frame = selected.select(F.col(f"`{id_column}`"), F.col("_metadata.file_path").alias(FILE_COLUMN),
                            F.col("_metadata.row_index").alias(ROW_COLUMN))
    frame = assign_split(frame, [id_column], split).select(FILE_COLUMN, ROW_COLUMN, SPLIT_COLUMN)
    log.info("typed ETL pass 1 reads %d columns of the Parquet source with pyarrow (Spark assigns splits)",
             len(columns))
    return DirectSource(frame=frame, columns=columns)
