"""Does adding workers make training faster? samples/s for 1, 2, ... workers against the machine's limit.

    .venv/bin/python bench/scaling_bench.py [--workers 2] [--models small comm] [--backends ps allreduce]
        [--rows 100000] [--features 64] [--batch-size 256] [--epochs 1] [--workdir /tmp/shardline-scaling-bench]

One SparkSession, local[max(2, most workers)] with spark.task.cpus=1. Not timed: the synthetic data set
run through the shard ETL once per worker count (N train shards for N workers; the same rows) and a
warm-up of the Spark Python workers (bench/_common.py, shared with e2e_bench.py). Then, per model
(small: MLP 64-128-10; comm: 64-1024-1024-10, ~4.4 MB of parameters, communication-bound) and per worker
count N (always 1, plus --workers; `--workers 4 8` where there are the cores):

  limit            N independent one-process trainers at once, as separate processes (plain torch, the
                   same loader, model, per-worker batch and steps on shard r of the N-shard set, 1 torch
                   thread each), set up first and released together: what N cores deliver with no
                   communication at all. N=1 is "one process".
  lockstep bound   (N > 1) the limit's rate × (each step's mean over its processes ÷ its slowest, summed
                   over the steps, the i-th steps paired): what a synchronous backend (sync PS,
                   allreduce) could keep of the limit with free communication, waiting each step for the
                   slowest rank on this box's step-time jitter (``Limit.lockstep``; an estimate).
  shardline <b>    `pipeline.launch.train` with N barrier tasks (N=1: a one-task barrier run),
                   train.backend ps (ps.mode=sync) and allreduce (optional: ps-overlap, ps.overlap=true;
                   ps-processes, ps.shards=--ps-shards (2) in shard processes; ps-hosts, ps.placement=hosts).

Each worker count is measured in --repeats rounds (default 3), each round the limit and then every backend
back to back; the table shows medians over the rounds. Columns: train() samples/s = train rows x epochs /
the train() call's wall (launch included); loop samples/s = samples / the epochs' own clocks (the
limit's: first start to last end); then loop samples/s ÷ the limit at the same N (the median over rounds
of each round's ratio to that round's limit), ÷ one process (likewise per round: a round with N > 1 also
runs one process alone, on shard 0 for the same steps, right after its limit), scaling efficiency (÷ N x one
process), and CPU ms per 1,000
samples (every worker process's CPU in the loop: steadier than wall on a shared box; the ps rows leave
out the driver's parameter server).

Without Spark (the `device` tool's 16-core machine has neither Java nor pyspark):

    python bench/scaling_bench.py --workers 8 --write-shards /tmp/set8        # here, with Spark: the ETL once
    python bench/scaling_bench.py --launcher processes --shards /tmp/set8 --workers 2 4 8   # there

`--launcher processes` runs the same `train()` with each barrier task a process of its own
(bench/_process_barrier.py says what that replaces) on a shard set written by the Spark ETL here
(`--write-shards`, for the largest N), regrouped into N shards of consecutive source shards for each N
(the same rows; its shard count must be a multiple of every N).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (CONF, base_overrides, fmt, independent_trainers, prepare_data, regroup,  # noqa: E402
                     shardline_run, spark_session, trainer_args, warm_up)
from _process_barrier import ProcessBarrierSession, add_launcher_options, check_launcher_options  # noqa: E402

MODELS = {"small": [128], "comm": [1024, 1024]}
BACKENDS = {"ps": ["train.backend=ps", "ps.mode=sync"], "allreduce": ["train.backend=allreduce"],
            "ps-overlap": ["train.backend=ps", "ps.mode=sync", "ps.overlap=true"],
            # the server's reduce and optimizer split over --ps-shards shard processes (a core each)
            "ps-processes": ["train.backend=ps", "ps.mode=sync", "ps.server_processes=true"],
            # issue 43: ps.placement=hosts on one host (one shard process, started by rank 0's task)
            "ps-hosts": ["train.backend=ps", "ps.mode=sync", "ps.placement=hosts"]}
DEFAULT_BACKENDS = ["ps", "allreduce"]


def backend_overrides(backend: str, args) -> list[str]:
    return BACKENDS[backend] + ([f"ps.shards={args.ps_shards}"] if backend == "ps-processes" else [])


def measure(spark, args, counts: list[int], manifests: dict, lines) -> list[dict]:
    """The table's rows: per model, per N, the limit and each backend."""
    from pipeline.config import load
    from pipeline.models import model_spec
    from pipeline.shards import steps_per_epoch

    rows: list[dict] = []
    for model in args.models:
        for n in counts:
            overrides = base_overrides(f"{args.workdir}/w{n}", "scalingbench", args.rows, args.features,
                                       MODELS[model], args.batch_size, args.epochs, n, args.master)
            cfg = load(str(CONF), overrides)
            manifest = manifests[n]
            steps = steps_per_epoch(manifest, n, cfg.train.batch_size)
            spec = model_spec(cfg.model, features=manifest.feature_set, num_classes=manifest.num_classes,
                              task=manifest.task)
            # --repeats rounds, each the limit then every backend back to back: each backend's ratio is
            # the median over rounds of its rate ÷ the same round's limit (a 2-core box drifts between
            # rounds more than within one).
            # ÷ one process likewise: each round with N > 1 also runs one process alone (shard 0, the same
            # steps) right after its limit, since the N=1 rounds ran minutes earlier on a box that drifts.
            limits, solos, runs = [], [], {b: [] for b in args.backends}
            for rep in range(args.repeats):
                limit = independent_trainers([trainer_args(manifest, spec, cfg, steps, r) for r in range(n)])
                limits.append(limit)
                lockstep = "" if limit.lockstep is None else f", lockstep bound {limit.lockstep:.3f}"
                lines(f"{model} x{n} round {rep + 1} limit: {limit.samples} samples, span {limit.span_s:.2f}s, "
                      f"per process loop {[round(t, 2) for t in limit.loop_s]}s, {limit.cpu_s:.1f} CPU s{lockstep}")
                solos.append(limit if n == 1 else independent_trainers([trainer_args(manifest, spec, cfg, steps, 0)]))
                if n > 1:
                    lines(f"{model} x{n} round {rep + 1} one process alone: {solos[-1].samples} samples, "
                          f"{solos[-1].rate:,.0f} samples/s")
                for backend in args.backends:
                    label = f"shardline {backend}"
                    try:
                        cfg_b = load(str(CONF), overrides + backend_overrides(backend, args))
                        run = shardline_run(spark, cfg_b, manifest)
                    except Exception as exc:  # one failed run must not lose the others
                        traceback.print_exc()
                        lines(f"{model} x{n} round {rep + 1} {label}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    runs[backend].append((run, limit, solos[-1]))
                    lines(f"{model} x{n} round {rep + 1} {label}: {run.steps} steps, {run.samples} samples; train() "
                          f"{run.wall_s:.1f}s, slowest run() {run.run_s:.1f}s, loop {run.loop_s:.1f}s, "
                          f"{run.cpu_s:.1f} CPU s; ÷ this round's limit {run.rate / limit.rate:.2f}")
            limit_rate = statistics.median(x.rate for x in limits)
            base = {"model": model, "n": n, "limit": limit_rate}
            rows.append({**base, "what": "limit (independent)", "samples": limits[0].samples, "wall_rate": "-",
                         "loop_rate": limit_rate, "per_one": statistics.median(x.rate / o.rate for x, o in zip(limits, solos)),
                         "ratio": 1.0, "cpu_per_k": statistics.median(1e6 * x.cpu_s / max(x.samples, 1) for x in limits)})
            bounds = [(x, o) for x, o in zip(limits, solos) if x.lockstep is not None]
            if bounds:  # N > 1
                rows.append({**base, "what": "lockstep bound", "samples": limits[0].samples, "wall_rate": "-",
                             "loop_rate": statistics.median(x.rate * x.lockstep for x, _ in bounds),
                             "per_one": statistics.median(x.rate * x.lockstep / o.rate for x, o in bounds),
                             "ratio": statistics.median(x.lockstep for x, _ in bounds), "cpu_per_k": "-"})
            for backend in args.backends:
                label, done = f"shardline {backend}", runs[backend]
                if not done:
                    rows.append({**base, "what": label, "samples": 0, "wall_rate": "error", "loop_rate": "error",
                                 "ratio": None,
                                 "cpu_per_k": "-"})
                    continue
                rows.append({**base, "what": label, "samples": done[0][0].samples,
                             "wall_rate": statistics.median(r.samples / r.wall_s for r, _, _ in done),
                             "loop_rate": statistics.median(r.rate for r, _, _ in done),
                             "ratio": statistics.median(r.rate / lim.rate for r, lim, _ in done),
                             "per_one": statistics.median(r.rate / o.rate for r, _, o in done),
                             "cpu_per_k": statistics.median(1e6 * r.cpu_s / max(r.samples, 1) for r, _, _ in done)
                             if all(r.cpu_s for r, _, _ in done) else "-"})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'model':<6} | {'N':>2} | {'':<22} | {'train() samples/s':>17} | {'loop samples/s':>14} | "
            f"{'÷ limit':>7} | {'÷ 1 process':>11} | {'efficiency':>10} | {'CPU ms/1k samples':>17}")
    out = [head, "-" * len(head)]
    for r in rows:
        per_one = r.get("per_one")  # the median of per-round ratios (none for a backend that failed)
        out.append(f"{r['model']:<6} | {r['n']:>2} | {r['what']:<22} | {fmt(r['wall_rate'], ',.0f'):>17} | "
                   f"{fmt(r['loop_rate'], ',.0f'):>14} | {fmt(r['ratio'], '.2f') if r['ratio'] else '-':>7} | "
                   f"{fmt(per_one, '.2f') if per_one else '-':>11} | "
                   f"{fmt(per_one / r['n'], '.2f') if per_one else '-':>10} | {fmt(r['cpu_per_k'], '.1f'):>17}")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2], help="worker counts besides 1")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, choices=list(BACKENDS))
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256, help="per worker; global = N x")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/shardline-scaling-bench")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per worker count (medians reported)")
    parser.add_argument("--ps-shards", type=int, default=2, help="the ps-processes backend's shard processes")
    add_launcher_options(parser)
    parser.add_argument("--write-shards", metavar="DIR",
                        help="only write the data set's shard set for the largest worker count to DIR (Spark ETL)")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.workers):
        parser.error("--workers: each count must be at least 1")
    check_launcher_options(parser, args)
    if args.write_shards and args.launcher != "spark":
        parser.error("--write-shards runs the Spark ETL: leave --launcher at spark")
    args.counts = sorted({1, *args.workers})
    args.master = f"local[{max(2, max(args.counts))}]"
    return args


def _cfg(args, n: int, hidden):
    from pipeline.config import load

    return load(str(CONF), base_overrides(f"{args.workdir}/w{n}", "scalingbench", args.rows, args.features, hidden,
                                          args.batch_size, args.epochs, n, args.master))


def run(spark, args, out=print) -> list[dict]:
    """Everything after the session: data, warm-up, the measurements, the printed report; the table's rows.
    ``spark`` needs at least max(args.counts) task slots."""
    import torch

    started = time.perf_counter()
    if args.launcher == "processes":
        from pipeline.shards import load_manifest

        written = load_manifest(args.shards)
        manifests = {n: regroup(written, n) for n in args.counts}  # same rows, N shards
        threads = "task processes reused between runs, OMP_NUM_THREADS=1"
    else:
        manifests = {n: prepare_data(spark, _cfg(args, n, MODELS["small"])) for n in args.counts}  # same rows
        env, _ = warm_up(spark, max(args.counts), cold=False)
        threads = f"Spark Python workers: torch threads {sorted({r['threads'] for r in env})}"
    warm_runs(spark, args, manifests[max(args.counts)])
    prep_s = time.perf_counter() - started
    notes: list[str] = []

    def note(line: str) -> None:  # as it happens (a long run shows progress), and again under the table
        notes.append(line)
        print(line, file=sys.stderr, flush=True)

    rows = measure(spark, args, args.counts, manifests, note)
    out("")
    out(f"data: {args.rows} rows x {args.features} features, train {manifests[1].split('train').rows} rows; per-worker "
        f"batch {args.batch_size}, {args.epochs} epoch(s); generate + ETL + warm-up {prep_s:.1f}s, not timed")
    out(f"host: {os.cpu_count()} cpus, spark {spark.version} {spark.conf.get('spark.master')}, torch "
        f"{torch.__version__}; {threads}")
    out("")
    out(table(rows))
    out("")
    for note in notes:
        out(f"  {note}")
    out(f"\nmeasured in {time.perf_counter() - started:.1f}s")
    return rows


def warm_runs(spark, args, manifest) -> None:
    """Not timed: one small-model run per backend with every task slot the bench will use, as an earlier
    job of the session would have left its Python workers (Spark reuses them; the process stand-in too):
    each task process's first training steps pay one-time costs (0.25-0.3 s measured on this box) that a
    short loop would otherwise count against the first run at each worker count."""
    from pipeline.config import load

    n = max(args.counts)
    overrides = base_overrides(f"{args.workdir}/warm", "scalingbench", args.rows, args.features, MODELS["small"],
                               args.batch_size, 1, n, args.master)
    for backend in args.backends:
        shardline_run(spark, load(str(CONF), overrides + backend_overrides(backend, args)), manifest)


def write_shards(spark, args, out=print) -> str:
    """The Spark ETL of the data set for the largest worker count, copied to ``args.write_shards``."""
    import shutil

    target = Path(args.write_shards)
    if target.exists() and any(target.iterdir()) and not (target / "manifest.json").exists():
        raise SystemExit(f"--write-shards {target}: the folder holds something other than a shard set; name an empty "
                         "or new folder")
    manifest = prepare_data(spark, _cfg(args, max(args.counts), MODELS["small"]))
    shutil.rmtree(target, ignore_errors=True)  # an earlier set's files must not travel with this one
    shutil.copytree(manifest.root, target)
    out(f"wrote {len(manifest.split('train').shards)} train shards ({manifest.split('train').rows} rows) to "
        f"{args.write_shards}: bench/scaling_bench.py --launcher processes --shards {args.write_shards}")
    return args.write_shards


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.launcher == "processes":
        spark = ProcessBarrierSession(max(args.counts))
    else:
        spark = spark_session(_cfg(args, 1, MODELS["small"]))
    try:
        if args.write_shards:
            write_shards(spark, args)
            return 0
        rows = run(spark, args)
    finally:
        spark.stop()
    return 1 if any(r["loop_rate"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
