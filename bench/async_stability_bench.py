"""Stability of asynchronous training: N seeds of a config in one ps.mode, test accuracy of each.

    .venv/bin/python bench/async_stability_bench.py [--mode async|ssp] [--runs 10] [--config conf/digits.yaml]
        [--workdir /tmp/shardline-async-bench] [--min-accuracy 0.93] [key.sub=value ...]

One embedded SparkSession; the ETL runs once, then `pipeline.launch.train` + `pipeline.evaluate.evaluate`
(test split) once per run with train.seed = 0..N-1 (initialization and shuffle). Arrival orders differ
too: odd runs make one rank a straggler (faults.delay_rank = seed % 2 ... , delay_ms = 1 from step 0), so
the pushes of the two ranks interleave differently from the even runs, where only scheduling decides.
Prints one line per run (seed, straggler, test accuracy, final train loss, mean/max staleness of the
server, seconds), then min / median / max, and exits 1 if any run is below --min-accuracy.
Extra arguments are config overrides applied to every run (e.g. ps.staleness_scale=none
ps.async_momentum=0.9 to see the unstable setting the issue reported).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_config(base, seed: int):
    from pipeline.config.loader import with_changes

    straggler = seed % 2 == 1
    faults = {"delay_rank": (seed // 2) % 2, "delay_ms": 1.0, "delay_step": 0} if straggler else {}
    return with_changes(base, train={"seed": seed}, faults=faults), straggler


def stability_runs(spark, base, runs: int, report=print) -> list[dict]:
    """ETL once, then one train + test evaluation per seed 0..runs-1; one dict per run (and one printed line)."""
    from pipeline.evaluate import evaluate
    from pipeline.launch.train import train
    from pipeline.steps import etl

    manifest = etl(spark, base)
    report(f"{'seed':>4} {'straggler':>9} {'test acc':>8} {'train loss':>10} {'stale mean':>10} {'stale max':>9} "
           f"{'s':>6}")
    results = []
    for seed in range(runs):
        cfg, straggler = run_config(base, seed)
        t0 = time.perf_counter()
        result = train(spark, cfg, manifest)
        metrics = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics
        stats = result.ps_stats or {}
        loss = result.history[-1].get("train_loss", float("nan")) if result.history else float("nan")
        row = {"seed": seed, "straggler": cfg.faults.delay_rank if straggler else None,
               "accuracy": metrics["accuracy"], "train_loss": loss,
               "staleness_mean": stats.get("staleness_mean", 0.0), "staleness_max": stats.get("staleness_max", 0),
               "seconds": time.perf_counter() - t0}
        results.append(row)
        report(f"{seed:>4} {('rank ' + str(row['straggler'])) if straggler else '-':>9} {row['accuracy']:>8.4f} "
               f"{loss:>10.4f} {row['staleness_mean']:>10.2f} {row['staleness_max']:>9} {row['seconds']:>6.1f}")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="async", choices=["async", "ssp", "sync", "average"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--config", default=str(REPO / "conf" / "digits.yaml"))
    parser.add_argument("--workdir", default="/tmp/shardline-async-bench")
    parser.add_argument("--min-accuracy", type=float, default=0.93)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from pipeline.config.loader import load
    from pipeline.session import get_or_create_spark

    base = load(args.config, [f"ps.mode={args.mode}", f"workdir={args.workdir}", "tracking.log_model=false",
                              "tracking.system_metrics_interval_s=null", *args.overrides])
    spark = get_or_create_spark(base.spark)
    started = time.perf_counter()
    print(f"mode {args.mode}, {args.runs} runs of {Path(args.config).name} "
          f"(lr {base.train.lr}, momentum {base.train.momentum}, staleness_scale {base.ps.staleness_scale}, "
          f"async_momentum {base.ps.async_momentum}); overrides: {' '.join(args.overrides) or 'none'}")
    try:
        accuracies = [r["accuracy"] for r in stability_runs(spark, base, args.runs,
                                                            lambda line: print(line, flush=True))]
    finally:
        spark.stop()
    low = [a for a in accuracies if a < args.min_accuracy]
    print(f"min {min(accuracies):.4f}  median {statistics.median(accuracies):.4f}  max {max(accuracies):.4f}  "
          f"below {args.min_accuracy}: {len(low)}/{len(accuracies)}  ({time.perf_counter() - started:.0f}s)")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
