"""Every rank evaluating a part of the validation split against rank 0 evaluating all of it: one command.

    .venv/bin/python bench/validation_bench.py [--rows 100000] [--hidden 1024 1024] [--batch-size 256]
        [--epochs 3] [--workers 2] [--backends ps allreduce] [--rounds 2] [--workdir /tmp/shardline-val-bench]

Until issue 17's change rank 0 alone evaluated the validation split at the end of each epoch, and with a
synchronous exchange the other ranks waited for it at the next epoch's first step. This runs the same
train() (train.profile on, the driver's PS) two ways, alternating ABBA in one Spark session: the plans as
shardline makes them (every rank evaluates its rows, pipeline.worker.validation.part_rows) and the plans
rewritten to the old placement (rank 0 every row, the other ranks none). Per backend it prints each
side's medians: the epochs' own clock summed (the slowest rank per epoch: the loop the scaling bench
times, which holds the waits for the evaluation of the epoch before), the slowest worker's run() (all
of it, the last epoch's evaluation too), each rank's wait for the exchange (pull wait, or the allreduce's
exchange) per step, and the last epoch's val_loss of both (the same split, the same figure up to the
reduction order), then every rank ÷ rank 0 for the two times.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CONF, base_overrides, prepare_data, spark_session  # noqa: E402

BACKENDS = {"ps": ["train.backend=ps"], "allreduce": ["train.backend=allreduce"]}
SIDES = ("every rank", "rank 0 alone")


def rank0_alone(plans):
    """The placement before the change: rank 0 evaluates every validation row, the others none."""
    files = next((p.validation_files for p in plans if p.validation_files), ())
    return [dataclasses.replace(p, validation_files=files if p.rank == 0 else (), validation_rows=None)
            for p in plans]


def _run(spark, cfg, manifest, side: str, captured: list) -> dict:
    from pipeline.launch import train
    from pipeline.launch.placement import driver_hosted

    original = driver_hosted.worker_plans
    if side == "rank 0 alone":
        driver_hosted.worker_plans = lambda *a, **k: rank0_alone(original(*a, **k))
    try:
        started = time.perf_counter()
        result = train(spark, cfg, manifest)
        wall = time.perf_counter() - started
    finally:
        driver_hosted.worker_plans = original
    by_rank = {}
    for reports in captured:  # pipeline.worker.timing.summarize's input: {rank: that rank's epoch report}
        for rank, report in reports.items():
            waits = by_rank.setdefault(rank, [])
            waits.append(float(report.get("time/pull_wait_ms", 0.0)) + float(report.get("time/exchange_other_ms", 0.0)))
    captured.clear()
    return {"loop_s": sum(row["epoch_seconds"] for row in result.history), "wall_s": wall,
            "run_s": max(r["seconds"] for r in result.ranks), "val_loss": result.history[-1].get("val_loss"),
            "val_rows": result.history[-1].get("val_rows"),
            "wait_ms": {rank: statistics.mean(w) for rank, w in sorted(by_rank.items())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=2, help="ABBA pairs: runs of each side")
    parser.add_argument("--workdir", default="/tmp/shardline-val-bench")
    args = parser.parse_args(argv)

    import pipeline.worker.timing as timing
    from pipeline.config import load

    base = base_overrides(args.workdir, "valbench", args.rows, args.features, args.hidden, args.batch_size,
                          args.epochs, args.workers, f"local[{args.workers}]") + ["train.profile=true"]
    cfg = load(str(CONF), base)
    spark = spark_session(cfg)
    manifest = prepare_data(spark, cfg)
    validation = manifest.split("validation").rows if "validation" in manifest.splits else 0
    if not validation:
        parser.error("the data set has no validation split (data.split.validation is 0)")
    captured: list = []
    summarize = timing.summarize

    def capturing(reports):  # each rank's own epoch report, before the driver averages the ranks
        captured.append(dict(reports))
        return summarize(reports)

    timing.summarize = capturing
    print(f"{args.workers} workers, MLP {args.features}-{'-'.join(map(str, args.hidden))}, batch {args.batch_size}, "
          f"{args.epochs} epochs, {manifest.split('train').rows} train rows, {validation} validation rows")
    runs = {(b, s): [] for b in args.backends for s in SIDES}
    for backend in args.backends:
        bcfg = load(str(CONF), base + BACKENDS[backend])
        _run(spark, bcfg, manifest, SIDES[0], captured)  # untimed: the first run of a backend warms up
        for i in range(args.rounds):
            for side in (SIDES if i % 2 == 0 else SIDES[::-1]):  # ABBA: neither side always runs second
                run = _run(spark, bcfg, manifest, side, captured)
                runs[backend, side].append(run)
                print(f"  {backend:<9} {side:<12}: loop {run['loop_s']:.2f} s, slowest run() {run['run_s']:.2f} s, "
                      f"train() {run['wall_s']:.2f} s; wait per step by rank "
                      f"{ {r: round(w, 2) for r, w in run['wait_ms'].items()} } ms; val_loss {run['val_loss']:.5f} "
                      f"over {run['val_rows']} rows", file=sys.stderr, flush=True)
    timing.summarize = summarize
    print(f"\n{'backend':<10} | {'side':<12} | {'loop s':>7} | {'run() s':>7} | {'wait ms/step by rank':<26} | val_loss")
    for (backend, side), done in runs.items():
        ranks = sorted(done[0]["wait_ms"])
        waits = {r: statistics.median(d["wait_ms"][r] for d in done) for r in ranks}
        print(f"{backend:<10} | {side:<12} | {statistics.median(d['loop_s'] for d in done):>7.2f} | "
              f"{statistics.median(d['run_s'] for d in done):>7.2f} | "
              f"{', '.join(f'{r}: {w:.2f}' for r, w in waits.items()):<26} | "
              f"{statistics.median(d['val_loss'] for d in done):.5f}")
    for backend in args.backends:
        new, old = runs[backend, SIDES[0]], runs[backend, SIDES[1]]
        print(f"{backend}: every rank ÷ rank 0 alone, median of per-pair ratios: loop "
              f"{statistics.median(n['loop_s'] / o['loop_s'] for n, o in zip(new, old)):.3f}, slowest run() "
              f"{statistics.median(n['run_s'] / o['run_s'] for n, o in zip(new, old)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
