"""Where a step's time goes (train.profile), per backend, on one small synthetic run: one command.

    .venv/bin/python bench/step_profile_bench.py [--rows 40000] [--features 64] [--hidden 128]
        [--batch-size 128] [--epochs 2] [--backends ps-sync ps-async ps-average allreduce]
        [--workdir /tmp/shardline-profile-bench] [--set ps.bucket_mb=2 ...] [--compare ps.overlap=true ...] [--rounds 3]
        [--workers 2] [--launcher processes --shards DIR]

One local[N] SparkSession (spark.task.cpus=1), N workers (--workers, 2), synthetic data through the shard
ETL once (not timed); or, where there is no Spark (the `device` tool's 16 cores), `--launcher processes
--shards DIR` on a set written by `scaling_bench.py --write-shards DIR` (bench/_process_barrier.py).
For each backend, `pipeline.launch.train` with train.profile=true; prints the last epoch's
breakdown (mean ms per step over ranks, share of the step; other = the step's time outside the named
phases), the parts' sum against the step, and the parameter server's own reduce / optimizer /
slowest-rank wait per update (ps backend). Then the first backend 5 more times, profile off/on/off/on/off:
median step_time_s off against on (the cost of profiling; run-to-run noise on a loaded box is larger), and
the timer calls of one step timed alone (off: no-op calls, no clock reads).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _process_barrier import ProcessBarrierSession, add_launcher_options, check_launcher_options  # noqa: E402

BACKENDS = {"ps-sync": ["train.backend=ps", "ps.mode=sync"], "ps-async": ["train.backend=ps", "ps.mode=async"],
            "ps-average": ["train.backend=ps", "ps.mode=average"], "allreduce": ["train.backend=allreduce"]}


def _step_time_ms(result) -> float:
    """The last epoch's mean step time over ranks, from the loop's own clock (profiled or not)."""
    row = result.history[-1]
    steps = [v for k, v in row.items() if k.endswith("/step_time_s")]
    return 1000.0 * sum(steps) / max(len(steps), 1)


def _timer_cost_us(profile: bool, steps: int = 200_000) -> float:
    """Microseconds per step of the loop's timer calls (start once, one lap per phase per step)."""
    from pipeline.worker.timing import PHASES, step_timer

    timer = step_timer(profile)
    timer.start()
    best = float("inf")
    for _ in range(3):  # the least disturbed of 3 (a loaded box)
        started = time.perf_counter()
        for _ in range(steps):
            for phase in PHASES:
                timer.lap(phase)
        best = min(best, time.perf_counter() - started)
    return 1e6 * best / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--workdir", default="/tmp/shardline-profile-bench")
    parser.add_argument("--compare", nargs="+", default=None, metavar="KEY=VALUE",
                        help="instead of the profiling-cost runs: the first backend 3 times as configured and 3 "
                             "times with these overrides, interleaved, profiled; median breakdown of each, the "
                             "server's reduce / optimizer per update and the driver's CPU per step")
    parser.add_argument("--rounds", type=int, default=3, help="--compare: runs of each side")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every run, e.g. ps.overlap=true ps.bucket_mb=2")
    parser.add_argument("--workers", type=int, default=2)
    add_launcher_options(parser)
    args = parser.parse_args()
    check_launcher_options(parser, args)

    from pipeline.config import load
    from pipeline.launch import train
    from pipeline.worker.timing import PHASES, PREFIX, table

    conf_path = str(REPO / "conf" / "synthetic.yaml")
    base = [f"workdir={args.workdir}", "name=profilebench", f"data.synthetic.rows={args.rows}",
            f"data.synthetic.features={args.features}", f"parallelism.data={args.workers}",
            f"spark.master=local[{args.workers}]", f"model.hidden={list(args.hidden)}",
            f"train.batch_size={args.batch_size}", f"train.epochs={args.epochs}", "tracking.log_model=false", *args.set]
    spark, manifest = _session_and_data(args, load(conf_path, base))

    profiled: dict[str, float] = {}
    for name in args.backends:
        started = time.perf_counter()
        result = train(spark, load(conf_path, base + BACKENDS[name] + ["train.profile=true"]), manifest)
        wall = time.perf_counter() - started
        row = result.history[-1]
        parts = sum(row[f"{PREFIX}{phase}_ms"] for phase in PHASES)
        step = row[f"{PREFIX}step_ms"]
        profiled[name] = _step_time_ms(result)
        print(f"\n== {name}: {result.steps} steps, {wall:.1f} s wall; epoch {row['epoch'] + 1} of {args.epochs}, "
              f"mean over ranks (slowest rank's step {row[f'{PREFIX}step_ms_max']:.3f} ms); "
              f"server slices (ps.shards or ps.bucket_mb buckets): {result.ps_stats.get('shards', 1)}")
        print(table(row))
        print(f"named parts {parts:.3f} ms = {100 * parts / step:.1f}% of the step "
              f"({'within' if parts >= 0.9 * step else 'NOT within'} 10%); pull_wait by rank "
              f"{row[f'{PREFIX}pull_wait_ms_min']:.3f}-{row[f'{PREFIX}pull_wait_ms_max']:.3f} ms (least-most)")
        if row.get("ps/updates"):  # the driver's PS: its side of the same epoch, per applied update
            print(f"server, same epoch (reduce, optimizer: summed over slices): reduce {row['ps/reduce_ms']:.3f} ms, "
                  f"optimizer {row['ps/optimizer_ms']:.3f} ms, "
                  f"slowest-rank wait {row['ps/sync_wait_ms']:.3f} ms per update, {row['ps/updates']:.0f} updates")
    first = args.backends[0]
    if args.compare:
        return _compare(args, spark, manifest, conf_path, base + BACKENDS[first], first)
    runs: dict[bool, list[float]] = {False: [], True: [profiled[first]]}
    keys: list[str] = []
    for profile in (False, True, False, True, False):  # interleaved: a loaded box drifts between runs
        result = train(spark, load(conf_path, base + BACKENDS[first] + [f"train.profile={str(profile).lower()}"]),
                       manifest)
        runs[profile].append(_step_time_ms(result))
        keys += [] if profile else [k for k in result.history[-1] if k.startswith(PREFIX)]
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"\n{first} step time, last epoch, median of {len(runs[False])} off / {len(runs[True])} on runs: "
          f"off {off:.3f} ms {[round(v, 3) for v in runs[False]]}, on {on:.3f} ms {[round(v, 3) for v in runs[True]]} "
          f"({100 * (on - off) / max(off, 1e-9):+.1f}%); off runs' time/* keys: {sorted(set(keys)) or 'none'}")
    print(f"timer calls of one step, measured alone: off {_timer_cost_us(False):.2f} us, "
          f"on {_timer_cost_us(True):.2f} us")
    return 0


def _session_and_data(args, cfg):
    """(the session, the shard set): Spark and the ETL, or the process stand-in and the written set."""
    if args.launcher == "processes":
        import atexit

        from _common import regroup

        from pipeline.shards import load_manifest

        session = ProcessBarrierSession(args.workers)
        atexit.register(session.stop)
        return session, regroup(load_manifest(args.shards), args.workers)
    from pipeline.etl import run_etl
    from pipeline.etl.synthetic import generate
    from pipeline.session import get_or_create_spark

    spark = get_or_create_spark(cfg.spark.model_copy(update={"conf": {**cfg.spark.conf, "spark.task.cpus": "1"}}))
    generate(spark, cfg.data, cfg.workdir)
    return spark, run_etl(spark, cfg)


def _compare(args, spark, manifest, conf_path: str, base: list[str], name: str) -> int:
    """A/B on one box in one session: as configured vs ``--compare`` overrides, alternating (a shared box
    drifts between runs), each side's per-phase medians over its runs."""
    from pipeline.config import load
    from pipeline.launch import train
    from pipeline.worker.timing import PHASES, PREFIX

    sides = {"as configured": base + ["train.profile=true"],
             " ".join(args.compare): base + ["train.profile=true", *args.compare]}
    rows: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(args.rounds):
        # Every other round in reverse (ABBA), so neither side always runs right after the other.
        for side, overrides in (sides.items() if i % 2 == 0 else reversed(sides.items())):
            cpu = time.process_time()
            result = train(spark, load(conf_path, overrides), manifest)
            # The driver process's CPU per step: with the PS in it (a threads-only server), the server's
            # cost, which on a box the workers fill is taken from their cores.
            driver_ms = 1000.0 * (time.process_time() - cpu) / max(result.steps, 1)
            rows[side].append({**result.history[-1], "slices": result.ps_stats.get("shards", 1),
                               "driver_cpu_ms": driver_ms})
    print(f"\n== {name} A/B, last epoch, median over {args.rounds} interleaved runs each (ms per step)")
    print(f"{'phase':<15}" + "".join(f"{side[:28]:>30}" for side in sides))
    for phase in (*PHASES, "other", "step"):
        key = f"{PREFIX}{phase}_ms"
        print(f"{phase:<15}" + "".join(f"{statistics.median(r[key] for r in rows[side]):>30.3f}" for side in sides))
    print(f"{'step, each run':<15}" + "".join(f"{str([round(r[PREFIX + 'step_ms'], 1) for r in rows[side]]):>30}"
                                            for side in sides))
    for key, label in (("ps/reduce_ms", "srv reduce"), ("ps/optimizer_ms", "srv optimizer"),
                       ("driver_cpu_ms", "driver CPU")):
        if all(key in r for side in sides for r in rows[side]):
            print(f"{label:<15}" + "".join(f"{statistics.median(r[key] for r in rows[side]):>30.3f}" for side in sides))
    print(f"{'server slices':<15}" + "".join(f"{rows[side][0]['slices']:>30}" for side in sides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
