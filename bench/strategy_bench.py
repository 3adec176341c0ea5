"""`train.backend: auto` against every strategy it could have picked, measured: on one host (local Spark) and
on the multi-host testbed (tests/cluster/testbed.py) at each link rate.

    sudo .venv/bin/python bench/strategy_bench.py [--scenarios one-host testbed] [--hosts 2 3]
        [--rates 1gbit 200mbit] [--models small 4.4MB clicks] [--allow async] [--epochs 2] [--out table.md]

For each scenario and model, the launch probes run once (fresh: train.auto.probe_cache_s=0) and the cost
model predicts every candidate the config leaves open (train.backend, ps.placement, ps.mode and
ps.compression all auto; train.auto.allow as given, default async). Then every candidate trains for
``--epochs`` epochs; its measured step is the last epoch's slowest rank's own clock (rank<r>/step_time_s),
the first epoch being the warm-up (with ``--repeats R``, the median of R trainings). The table gives, for each scenario and model, each candidate's predicted
and measured step and the prediction error |predicted - measured| / measured, auto's pick, the fastest
measured, and pick / fastest (the issue's targets: <= 1.10, every error <= 25 %).

Models: `small` (64 features, hidden [128], 39 KB), `4.4MB` (hidden [1024, 1024]), both on synthetic data;
`clicks` (the click model with its categorical tables as sparse rows on the PS, tests/cluster's size).
The figures are one run's; the table says on which machine.
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

AUTO = ["train.backend=auto", "ps.placement=auto", "ps.mode=auto", "ps.compression=auto",
        "train.auto.probe_cache_s=0"]
COMMON = ["tracking.log_model=false", "timeouts.step_s=120", "train.checkpoint_every=100000",
          "train.checkpoint_every_s=null", "train.divergence.enabled=false"]
MODELS = {
    "small": ("synthetic.yaml", ["data.synthetic.rows=200000", "data.synthetic.features=64", "model.hidden=[128]",
                                 "train.batch_size=256"]),
    "4.4MB": ("synthetic.yaml", ["data.synthetic.rows=16000", "data.synthetic.features=64",
                                 "model.hidden=[1024,1024]", "train.batch_size=256"]),
    "clicks": ("clicks.yaml", ["data.clicks.rows=20000", "data.clicks.vocab=2000", "data.clicks.big_vocab=20000",
                               "model.hidden=[64]", "ps.sparse.min_rows=50"]),
}


def measured_step_s(history: list[dict]) -> float:
    last = history[-1]
    clocks = [v for k, v in last.items() if k.endswith("/step_time_s")]
    return max(clocks)


def run_scenario(spark, scenario: str, n: int, workdir: str, models: list[str], allow: list[str], epochs: int,
                 extra: list[str], emit, repeats: int = 1) -> None:
    """Every model of one scenario: probe, predict, then train every candidate."""
    from pipeline.config import load
    from pipeline.config.loader import with_changes
    from pipeline.etl import run_etl
    from pipeline.etl.synthetic import generate
    from pipeline.launch import train
    from pipeline.launch.train import resolve_strategy

    for model in models:
        config, overrides = MODELS[model]
        allowed = f"train.auto.allow=[{','.join(allow)}]"
        cfg = load(str(REPO / "conf" / config), [f"workdir={workdir}/{model}", f"name=strat-{model}",
                                                  f"parallelism.data={n}", f"train.epochs={epochs}", *COMMON,
                                                  *overrides, *extra, *AUTO, allowed])
        if cfg.data.source == "synthetic":
            generate(spark, cfg.data, cfg.workdir)
        manifest = run_etl(spark, cfg)
        started = time.perf_counter()
        _, decision = resolve_strategy(spark, cfg, manifest)
        probe_s = time.perf_counter() - started
        for row in decision.rows:
            if row.prediction is None:
                continue
            concrete = with_changes(cfg, **row.candidate.changes())
            steps = sorted(measured_step_s(train(spark, concrete, manifest).history) for _ in range(repeats))
            emit({"scenario": scenario, "model": model, "strategy": row.candidate.name,
                  "pick": row.candidate == decision.pick, "predicted_ms": row.prediction.step_s * 1e3,
                  "terms_ms": {k: v * 1e3 for k, v in row.prediction.terms.items()},
                  "measured_ms": steps[len(steps) // 2] * 1e3, "measured_all_ms": [s * 1e3 for s in steps],
                  "probe_s": probe_s,
                  "probes": decision.probes.to_dict()})


def repredict(rows: list[dict]) -> list[dict]:
    """The same measurements with the predictions and picks of the cost model as it is now, from each row's
    recorded probes (the model is a pure function of them): for a change of its constants after a run."""
    from pipeline.config import load
    from pipeline.launch.strategy import Probes, decide

    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["model"]), []).append(r)
    for (scenario, model), rs in groups.items():
        config, overrides = MODELS[model]
        allowed = f"train.auto.allow=[{','.join(sorted({f for r in rs for f in _freedoms(r['strategy'])}))}]"
        cfg = load(str(REPO / "conf" / config), [*overrides, *AUTO, allowed, f"parallelism.data={rs[0]['probes']['ranks']}"])
        decision = decide(cfg, Probes(**rs[0]["probes"]))
        by_name = {row.candidate.name: row.prediction for row in decision.rows if row.prediction is not None}
        for r in rs:
            prediction = by_name[r["strategy"]]
            out.append({**r, "predicted_ms": prediction.step_s * 1e3, "pick": r["strategy"] == decision.pick.name,
                        "terms_ms": {k: v * 1e3 for k, v in prediction.terms.items()}})
    return out


def _freedoms(name: str) -> list[str]:
    return [m for m in ("async", "ssp", "average") if f" {m}" in name]


def emit(row: dict) -> None:
    print("STRATBENCH " + json.dumps(row), flush=True)


def inside(args) -> None:
    """In the spark-submit application on N testbed hosts: every rate, every model."""
    from pipeline.session import get_or_create_spark
    from pipeline.config import load
    from tests.cluster.testbed import Testbed

    bed = Testbed.load(args.state)
    spark = get_or_create_spark(load(str(REPO / "conf" / "synthetic.yaml")).spark)
    try:
        for rate in args.rates:
            bed.shape(rate)
            run_scenario(spark, f"{args.n} hosts, {rate}", args.n, f"{args.workdir}/{rate}", args.models, args.allow,
                         args.epochs, ["workdir_on_every_host=true"], emit, args.repeats)
    finally:
        bed.shape(None)


def one_host(args, rows: list[dict]) -> None:
    from pipeline.config import load
    from pipeline.session import get_or_create_spark
    import tempfile

    spark = get_or_create_spark(load(str(REPO / "conf" / "synthetic.yaml"), ["spark.master=local[2]"]).spark)
    with tempfile.TemporaryDirectory(prefix="sl-stratbench-") as root:
        def keep(row: dict) -> None:
            rows.append(row)
            print(_line(row), flush=True)
            if args.json:
                emit(row)
        run_scenario(spark, "one host", 2, root, args.models, args.allow, args.epochs, [], keep, args.repeats)
    spark.stop()


def _line(r: dict) -> str:
    return (f"{r['scenario']:<18} {r['model']:<7} {r['strategy']:<22} predicted {r['predicted_ms']:8.2f} ms, "
            f"measured {r['measured_ms']:8.2f} ms{'  <- auto' if r['pick'] else ''}")


def table(rows: list[dict]) -> str:
    lines = ["| scenario | model | strategy | predicted ms | measured ms | error | auto |", "|---|---|---|---|---|---|---|"]
    summary = ["| scenario | model | auto's pick | fastest measured | pick ÷ fastest (≤ 1.10) | worst error (≤ 25 %) | probe s |",
               "|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["model"]), []).append(r)
    for (scenario, model), rs in groups.items():
        for r in sorted(rs, key=lambda r: r["measured_ms"]):
            error = abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
            lines.append(f"| {scenario} | {model} | {r['strategy']} | {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} "
                         f"| {100 * error:.0f} % | {'pick' if r['pick'] else ''} |")
        fastest = min(rs, key=lambda r: r["measured_ms"])
        pick = next(r for r in rs if r["pick"])
        worst = max(abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rs)
        summary.append(f"| {scenario} | {model} | {pick['strategy']} | {fastest['strategy']} | "
                       f"{pick['measured_ms'] / fastest['measured_ms']:.2f} | {100 * worst:.0f} % | {pick['probe_s']:.2f} |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    return ("\n".join(summary) + "\n\n" + "\n".join(lines) +
            f"\n\n(one run of `bench/strategy_bench.py`, {time.strftime('%Y-%m-%d')}, {machine})\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["one-host", "testbed"], choices=["one-host", "testbed"])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--allow", nargs="*", default=["async"], help="train.auto.allow of the auto config")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="trainings of each candidate; the median is kept")
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--json", action="store_true", help="also print every row as a STRATBENCH JSON line")
    parser.add_argument("--rows-out", help="also write every row (predictions, terms, probes, measurements) as JSON here")
    parser.add_argument("--repredict", nargs="+", metavar="ROWS.json",
                        help="no runs: the table of these --rows-out files, predicted and picked by the cost model as it is now")
    from _testbed import parse_or_run_inside

    args = parse_or_run_inside(parser, inside)
    if args is None:
        return 0
    if args.repredict:
        rows = repredict([r for path in args.repredict for r in json.loads(Path(path).read_text())])
        print(table(rows))
        return 0
    rows: list[dict] = []
    if "one-host" in args.scenarios:
        one_host(args, rows)
    if "testbed" in args.scenarios:
        from _testbed import run_on_testbed

        code, bed_rows = run_on_testbed(
            __file__, args.hosts, tag="STRATBENCH", prefix="sl-stratbench-",
            inside_args=lambda bed, root, n: ["--state", bed.root, "--workdir", str(Path(root) / f"work-{n}"),
                                              "--n", str(n), "--rates", *args.rates, "--models", *args.models,
                                              "--epochs", str(args.epochs), "--repeats", str(args.repeats),
                                              "--allow", *args.allow],
            announce=lambda n: f"{len(args.rates)} rates x {len(args.models)} models, every candidate", show=_line)
        rows += bed_rows
        if code:
            print(table(rows))
            if args.rows_out:
                Path(args.rows_out).write_text(json.dumps(rows, indent=1))
            return code
    text = table(rows)
    print(text)
    if args.rows_out:
        Path(args.rows_out).write_text(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
