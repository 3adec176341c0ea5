"""Batch scoring throughput: `shardline score` vs `mlflow.pyfunc.spark_udf` on the same model and rows.

    .venv/bin/python bench/score_bench.py [--rows 1000000] [--workdir /tmp/score_bench]

Untimed setup: land the synthetic data set (conf/synthetic.yaml, data.synthetic.rows=--rows), ETL, train
1 epoch, log the model (pt2) and promote it to models:/NAME@champion; then write the same raw rows,
standardized with the manifest's statistics into one array<float> column (the input the pt2 pyfunc model's
tensor signature takes), as Parquet.

Timed, each end to end (model resolution/load included) and writing Parquet under /tmp:
  (a) pipeline.score.score on the raw rows (cast, invalid-row check, standardize, infer, argmax + label
      mapping + probabilities),
  (b) mlflow.pyfunc.spark_udf(spark, "models:/NAME@champion", result_type="array<float>") applied to the
      pre-standardized array column (outputs the logits).
Prints rows/s of each, the ratio (a)/(b), and the peak RSS of this process tree (driver JVM + Python
workers) during each phase, sampled with ps every 0.25 s.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


class TreeRss:
    """Peak total RSS (MiB) of this process and all its descendants, sampled with `ps`."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,rss="], capture_output=True, text=True).stdout
        children, rss = {}, {}
        for line in out.splitlines():
            pid, ppid, kb = (int(v) for v in line.split())
            children.setdefault(ppid, []).append(pid)
            rss[pid] = kb
        total, stack = 0, [os.getpid()]
        while stack:
            pid = stack.pop()
            total += rss.get(pid, 0)
            stack.extend(children.get(pid, []))
        return total // 1024

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workdir", default="/tmp/score_bench")
    args = parser.parse_args()

    import logging

    from pipeline import steps
    from pipeline.config import load
    from pipeline.etl.synthetic import synthetic_raw_path
    from pipeline.score import score
    from pipeline.session import get_or_create_spark

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pipeline.score").setLevel(logging.INFO)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    name = "synthetic-score-bench"
    cfg = load(os.path.join(REPO, "conf", "synthetic.yaml"),
               [f"workdir={work}", f"data.synthetic.rows={args.rows}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                f"tracking.registered_model={name}", "train.epochs=1", "parallelism.data=2",
                "score.keep_columns=[id]"])
    spark = get_or_create_spark(cfg.spark)
    print(f"spark {spark.version}, master {spark.sparkContext.master}, "
          f"defaultParallelism {spark.sparkContext.defaultParallelism}", flush=True)

    t0 = time.perf_counter()
    raw = str(steps.generate(spark, cfg))
    outcome = steps.run_all(spark, cfg)
    promotion = steps.promote(spark, cfg, run_id=outcome.run_id, model_uri=outcome.model_uri)
    manifest = steps.load_shards(cfg)
    print(f"setup (untimed): {args.rows} rows x {manifest.num_features} features landed in {raw}, ETL + 1 epoch "
          f"+ log + promote in {time.perf_counter() - t0:.1f}s; test accuracy "
          f"{outcome.test_metrics.get('accuracy', float('nan')):.4f}; version {promotion.version} -> "
          f"{promotion.alias}", flush=True)

    # The pyfunc's input: the same raw rows standardized exactly like the ETL, as one array<float> column.
    from pyspark.sql import functions as F

    standardized_path = os.path.join(work, "standardized.parquet")
    df = spark.read.parquet(raw)
    vector = F.array(*[((F.col(c).cast("double") - m) * (1.0 / s)).cast("float")
                       for c, m, s in zip(manifest.feature_columns, manifest.means, manifest.stds)])
    df.select("id", vector.alias("features")).write.mode("overwrite").parquet(standardized_path)

    model_uri = f"models:/{name}@champion"
    out_a, out_b = "/tmp/score_bench_shardline.parquet", "/tmp/score_bench_pyfunc.parquet"
    for path in (out_a, out_b):
        shutil.rmtree(path, ignore_errors=True)

    with TreeRss() as rss_a:
        started = time.perf_counter()
        result = score(spark, cfg, model_uri, raw, out_a)
        seconds_a = time.perf_counter() - started
    rows_a = result.input_rows
    print(f"(a) shardline score: {rows_a} rows ({result.scored_rows} scored, {result.invalid_rows} invalid) in "
          f"{seconds_a:.2f}s = {rows_a / seconds_a:,.0f} rows/s; peak RSS of process tree {rss_a.peak} MiB",
          flush=True)

    import mlflow
    import mlflow.pyfunc

    mlflow.set_tracking_uri(steps.tracking_uri(cfg))
    mlflow.set_registry_uri(steps.tracking_uri(cfg))
    with TreeRss() as rss_b:
        started = time.perf_counter()
        udf = mlflow.pyfunc.spark_udf(spark, model_uri, result_type="array<float>", env_manager="local")
        frame = spark.read.parquet(standardized_path)
        frame.select("id", udf("features").alias("prediction")).write.mode("errorifexists").parquet(out_b)
        seconds_b = time.perf_counter() - started
    rows_b = spark.read.parquet(out_b).count()
    print(f"(b) mlflow.pyfunc.spark_udf: {rows_b} rows in {seconds_b:.2f}s = {rows_b / seconds_b:,.0f} rows/s; "
          f"peak RSS of process tree {rss_b.peak} MiB", flush=True)

    # Same model, same rows: the argmax of the pyfunc's logits must be shardline's class predictions.
    a = spark.read.parquet(out_a).select("id", "prediction")
    b = spark.read.parquet(out_b).select("id", F.array_position(
        F.col("prediction"), F.array_max("prediction")).alias("b_index"))
    labels = [int(v) for v in manifest.label_mapping]
    mapping = F.element_at(F.array(*[F.lit(v) for v in labels]), F.col("b_index").cast("int"))
    disagree = a.join(b, "id").where(F.col("prediction") != mapping).count()
    print(f"prediction disagreements between (a) and (b): {disagree} of {rows_a}")
    ratio = (rows_a / seconds_a) / (rows_b / seconds_b)
    print(f"RESULT rows={rows_a} shardline_rows_per_s={rows_a / seconds_a:.0f} pyfunc_rows_per_s="
          f"{rows_b / seconds_b:.0f} ratio={ratio:.2f} (goal >= 1.0) peak_rss_mb_shardline={rss_a.peak} "
          f"peak_rss_mb_pyfunc={rss_b.peak}")
    spark.stop()


if __name__ == "__main__":
    main()
