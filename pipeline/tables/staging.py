"""What the Delta and Iceberg score writers share: Spark's tasks staging the Parquet files a commit then adds
(`stage_files`), the scores' schema as a table takes it (`nullable`), and what an append reports (`Appended`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Appended:
    table: str
    version: Optional[int]  # the Delta version, or the Iceberg snapshot id, the commit made
    files: list[str]  # URLs of the committed data files
    rows: int


def nullable(schema):
    """`schema` (pa.Schema) with every column nullable: keep_null rows, an unregistered model's version."""
    import pyarrow as pa

    return pa.schema([f.with_nullable(True) for f in schema])


def stage_files(df, folder: str) -> list[dict]:
    """Spark's tasks write `df` as Parquet files into `folder` (a URL or local path; one file a task, by
    pyarrow on any store: udfs/arrow_files.py); returns [{path (in the store), rows, size, mtime_ms}] of the
    files with rows that successful attempts reported, and deletes every other file there (a failed or
    speculative attempt's, an empty task's). The Delta and Iceberg writers then commit these in one transaction;
    until then no table version names them, so no reader sees them."""
    import time

    import pyarrow.fs as pafs

    from pipeline.storage import ensure_dir, resolve
    from udfs.arrow_files import WRITTEN_DDL, make_write_fn

    fs, path = resolve(folder)
    ensure_dir(fs, path)  # local (or shared) paths: the writers open files, they create no folders
    rows = {r["path"]: r["rows"] for r in df.mapInArrow(make_write_fn(fs, path), WRITTEN_DDL).collect()}
    files = []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        if rows.get(info.path):
            mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
            files.append({"path": info.path, "rows": rows[info.path], "size": info.size, "mtime_ms": int(mtime * 1e3)})
        else:
            fs.delete_file(info.path)
    return sorted(files, key=lambda f: f["path"])
