"""Shard ETL wall time / a plain df.write.parquet of the same preprocessed frame.

    .venv/bin/python bench/etl_bench.py [--rows 1000000] [--features 64] [--workdir /tmp/shardline-etl-bench]

The synthetic data set is generated first (not timed). Then, each on a warm session:
  shard ETL: `run_etl` (clean + counts, label mapping, split, train statistics, pack, balanced shards,
             manifest, atomic commit);
  plain:     the same preprocessed frame (cast, hash split, standardized features packed into one
             array<float> column with the ETL's statistics) written once with df.write.parquet.
Prints both times and their ratio (target <= 1.15).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/shardline-etl-bench")
    args = parser.parse_args()

    from pyspark.sql import functions as F

    from pipeline.config import load
    from pipeline.etl import run_etl
    from pipeline.etl.split import assign_split
    from pipeline.etl.synthetic import generate
    from pipeline.session import get_or_create_spark

    cfg = load(str(REPO / "conf" / "synthetic.yaml"), [
        f"workdir={args.workdir}", f"data.synthetic.rows={args.rows}", f"data.synthetic.features={args.features}",
        f"parallelism.data={args.workers}", "name=etlbench"])
    spark = get_or_create_spark(cfg.spark)
    raw = generate(spark, cfg.data, cfg.workdir)
    run_etl(spark, cfg)  # warm-up: the first job of a session pays JIT and Python-worker start

    started = time.perf_counter()
    manifest = run_etl(spark, cfg)
    etl_s = time.perf_counter() - started

    features = list(manifest.feature_columns)
    out = Path(args.workdir) / "plain"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    df = spark.read.parquet(str(raw))
    df = df.select("id", *[F.expr(f"try_cast({c} AS DOUBLE)").alias(c) for c in features], "label")
    df = assign_split(df, ["id"], cfg.data.split)
    packed = F.array(*[((F.col(c) - m) / s).cast("float") for c, m, s in zip(features, manifest.means, manifest.stds)])
    df.select(packed.alias("features"), F.col("label"), F.col("__split").alias("split")).write.parquet(str(out))
    plain_s = time.perf_counter() - started

    print(f"rows: {args.rows} x {args.features} features, {args.workers} workers")
    print(f"shard ETL:   {etl_s:.1f} s")
    print(f"plain write: {plain_s:.1f} s")
    print(f"ETL / plain write = {etl_s / plain_s:.2f}  (target <= 1.15)")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
