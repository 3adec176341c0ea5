"""The ETL of a Delta table vs the same rows as plain Parquet, side by side in one run.

    .venv/bin/python bench/table_etl_bench.py [--rows 1000000] [--features 16] [--files 8] [--repeats 2]
        [--workdir /tmp/shardline-table-bench] [--source delta|iceberg]

Not timed: the rows (id, f0..f{n-1} normal, a 10-class label) are written once as --files Parquet files
and as a Delta table of the same --files files (deltalake's write_deltalake, one commit per file; or an
Iceberg table through pyiceberg's SQL catalog), plus an untimed warm-up ETL of each on a small copy in
the same local[2] session (JIT, Python workers, imports). Then `run_etl` alternates parquet, table,
parquet, table... --repeats times, each into a fresh shard folder; the best wall time of each is kept.
The table's ETL includes pinning its version (the log replay / scan planning on the driver).

Prints each run's wall time and input rows, then table ÷ parquet of the best wall times. Spark reads
local Parquet itself (JVM); a table's files are read by pyarrow in the Python workers
(udfs/table_read.py), so the ratio is what honouring the table's log costs over a plain folder.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rows(start: int, count: int, features: int):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(start)
    x = rng.normal(size=(count, features))
    label = (np.abs(x[:, 0] * 3 + x[:, 1]) * 2).astype(int) % 10
    columns = {"id": np.arange(start, start + count)} | {f"f{i}": x[:, i] for i in range(features)}
    return pa.table({**columns, "label": label.astype(str)})


def land(root: Path, rows: int, features: int, files: int, source: str) -> tuple[str, str]:
    """(parquet folder, table path or identifier) holding the same rows, written once per spec."""
    import pyarrow.parquet as pq

    spec = root / f"{source}-{rows}x{features}-{files}"
    parquet, table = spec / "parquet", spec / "table"
    if (spec / "_DONE").exists():
        return str(parquet), (str(table) if source == "delta" else "bench.rows")
    shutil.rmtree(spec, ignore_errors=True)
    parquet.mkdir(parents=True)
    step = -(-rows // files)
    catalog = None
    for i, start in enumerate(range(0, rows, step)):
        part = _rows(start, min(step, rows - start), features)
        pq.write_table(part, parquet / f"part-{i:04d}.parquet")
        if source == "delta":
            import deltalake

            deltalake.write_deltalake(str(table), part, mode="append")
        else:
            if catalog is None:
                from pyiceberg.catalog.sql import SqlCatalog

                catalog = SqlCatalog("bench", uri=f"sqlite:///{spec}/catalog.db", warehouse=f"file://{table}")
                catalog.create_namespace("bench")
                catalog.create_table("bench.rows", schema=part.schema)
            catalog.load_table("bench.rows").append(part)
    (spec / "_DONE").write_text("")
    return str(parquet), (str(table) if source == "delta" else "bench.rows")


def config(workdir: Path, name: str, source: str, path: str, features: int, catalog_dir: Path | None):
    from pipeline.config import build

    data = {"source": source, "path": path, "id_column": "id", "features": [f"f{i}" for i in range(features)]}
    if source == "iceberg":
        data["iceberg"] = {"name": "bench", "catalog": {"type": "sql", "uri": f"sqlite:///{catalog_dir}/catalog.db",
                                                        "warehouse": f"file://{catalog_dir}/table"}}
    return build({"name": name, "workdir": str(workdir), "parallelism": {"data": 2},
                  "spark": {"master": "local[2]"}, "data": data})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--source", choices=("delta", "iceberg"), default="delta")
    parser.add_argument("--workdir", default="/tmp/shardline-table-bench")
    args = parser.parse_args(argv)

    from pipeline.etl import run_etl
    from pipeline.session import get_or_create_spark

    root = Path(args.workdir)
    big = land(root / "data", args.rows, args.features, args.files, args.source)
    small = land(root / "data", 20_000, args.features, 2, args.source)
    spec = lambda rows, files: root / "data" / f"{args.source}-{rows}x{args.features}-{files}"  # noqa: E731
    cfg = config(root / "work", "warm", "parquet", small[0], args.features, None)
    spark = get_or_create_spark(cfg.spark)
    for kind, path in (("parquet", small[0]), (args.source, small[1])):  # untimed warm-ups
        run_etl(spark, config(root / "work", f"warm-{kind}", kind, path, args.features, spec(20_000, 2)))
    best: dict[str, float] = {}
    for repeat in range(args.repeats):
        for kind, path in (("parquet", big[0]), (args.source, big[1])):
            cfg = config(root / "work", f"{kind}-{repeat}", kind, path, args.features, spec(args.rows, args.files))
            shutil.rmtree(root / "work" / "shards" / cfg.name, ignore_errors=True)
            started = time.perf_counter()
            manifest = run_etl(spark, cfg)
            wall = time.perf_counter() - started
            best[kind] = min(best.get(kind, wall), wall)
            print(f"{kind:8s} run {repeat + 1}: {wall:6.2f} s, {manifest.etl_report['input_rows']} input rows",
                  flush=True)
    print(f"{args.source} ÷ parquet ETL wall time (best of {args.repeats}, {args.rows} rows x {args.features} "
          f"features, {args.files} files): {best[args.source]:.2f} s / {best['parquet']:.2f} s = "
          f"{best[args.source] / best['parquet']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
