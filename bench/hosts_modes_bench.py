"""Every PS mode with the shards on the workers' hosts against the same mode with the PS on the driver:
the digits pipeline's test accuracy on the multi-host testbed (tests/cluster/testbed.py), 2 and 3 hosts.

    sudo .venv/bin/python bench/hosts_modes_bench.py [--hosts 2 3] [--modes sync ssp async average] [--epochs 8]
        [--repeats 1]

For each N, one spark-submit application on N testbed hosts lands the digits once (on a folder every
namespace sees: `workdir_on_every_host`), then runs the whole pipeline (ETL, training, evaluation) for each
mode with `ps.placement=hosts` and with `ps.placement=driver`, and prints each run's test accuracy and
the difference of the means. Sync and average runs are the same bits by design
(tests/pipeline/launch/placement/test_hosts_spread.py); ssp and async apply pushes in arrival order, so two
runs of one placement differ too: with ``--repeats R`` each pair runs R times, alternating, and the table gives
each placement's lowest and highest accuracy beside the means. The table says on which machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODES = {"sync": ["ps.mode=sync"], "ssp": ["ps.mode=ssp", "ps.staleness=2"], "async": ["ps.mode=async"],
         "average": ["ps.mode=average", "ps.sync_every=4"]}
PLACEMENTS = ("hosts", "driver")


def inside(args) -> None:
    """In the spark-submit application (the driver): every mode x placement, one pipeline each."""
    from pipeline import steps
    from pipeline.config import load
    from pipeline.session import get_or_create_spark

    base = [f"workdir={args.workdir}", "workdir_on_every_host=true", f"parallelism.data={args.n}",
            f"train.epochs={args.epochs}", "tracking.log_model=false", "tracking.system_metrics_interval_s=null",
            f"data.shards_dir={args.workdir}/shards"]
    spark = None
    for mode in args.modes:
        for placement in [p for _ in range(args.repeats) for p in PLACEMENTS]:
            cfg = load(str(REPO / "conf" / "digits.yaml"), [*base, f"name=modes-{mode}-{placement}",
                                                           f"tracking.uri=sqlite:///{args.workdir}/mlflow.db",
                                                           *MODES[mode], f"ps.placement={placement}"])
            spark = spark or get_or_create_spark(cfg.spark)
            started = time.perf_counter()
            metrics = steps.run_all(spark, cfg).test_metrics
            print("MODESBENCH " + json.dumps({"n": args.n, "mode": mode, "placement": placement,
                                              "accuracy": metrics["accuracy"],
                                              "seconds": time.perf_counter() - started}), flush=True)


def table(rows: list[dict]) -> str:
    by: dict[tuple, list[float]] = {}
    for r in rows:
        by.setdefault((r["n"], r["mode"], r["placement"]), []).append(r["accuracy"])

    def cell(values: list[float]) -> str:
        mean = sum(values) / len(values)
        return f"{mean:.4f}" if len(values) == 1 else f"{mean:.4f} ({min(values):.4f}–{max(values):.4f}, {len(values)} runs)"

    lines = ["| N | mode | test accuracy, shards on the hosts | PS on the driver | hosts − driver (pp, means) |",
             "|---|---|---|---|---|"]
    for (n, mode, placement), values in sorted(by.items()):
        other = by.get((n, mode, "driver"))
        if placement == "hosts" and other:
            delta = sum(values) / len(values) - sum(other) / len(other)
            lines.append(f"| {n} | {mode} | {cell(values)} | {cell(other)} | {100 * delta:+.2f} |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    return "\n".join(lines) + f"\n\n(one run of `bench/hosts_modes_bench.py`, {time.strftime('%Y-%m-%d')}, {machine})\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode and placement (alternating)")
    from _testbed import parse_or_run_inside

    args = parse_or_run_inside(parser, inside)
    if args is None:
        return 0
    from _testbed import run_on_testbed

    code, rows = run_on_testbed(
        __file__, args.hosts, tag="MODESBENCH", prefix="sl-modesbench-",
        inside_args=lambda bed, root, n: ["--workdir", str(Path(root) / f"work-{n}"), "--n", str(n), "--epochs",
                                          str(args.epochs), "--repeats", str(args.repeats), "--modes", *args.modes],
        announce=lambda n: f"{len(args.modes) * len(PLACEMENTS) * args.repeats} pipelines",
        show=lambda r: (f"N={r['n']} {r['mode']:<8} {r['placement']:<7} accuracy {r['accuracy']:.4f} "
                        f"({r['seconds']:.0f} s)"))
    if code:
        return code
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
