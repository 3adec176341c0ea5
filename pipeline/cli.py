"""The `shardline` command: generate | etl | train | evaluate | run | promote | score | workflow | tune | plan,
each on a layered config plus overrides.

    shardline run --config conf/digits.yaml parallelism.data=2 train.epochs=5 ps.mode=sync
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional, Sequence

from pipeline.errors import ShardlineError

log = logging.getLogger("pipeline.cli")

COMMANDS = {
    "generate": "write the synthetic data set (data.synthetic: rows, features, classes, seed) as raw Parquet",
    "etl": "read the source, clean, split, standardize and write balanced shards + manifest",
    "train": "train on the shard set with barrier workers and the driver parameter server",
    "evaluate": "evaluate the last trained model on the test split (in Spark) and log to its run",
    "run": "etl, train and evaluate in one MLflow run",
    "promote": "register the last trained model; alias champion if it beats the champion on the test split, "
               "else challenger",
    "score": "score a Parquet path or table with a tracked model (--model models:/NAME@champion --input ... "
             "--output ...); Parquet predictions written atomically",
    "workflow": "scheduled run: ETL only new date partitions, train on all, evaluate, promote (no-op when "
                "nothing changed)",
    "tune": "hyperparameter search (Optuna) over tune.space: each trial a training run nested under one MLflow "
            "run; resumes an interrupted study; writes and registers the best",
    "plan": "the train.backend=auto table without training: each strategy's predicted step on an assumed cluster "
            "(--hosts 16 --link-gbit 10); strategy keys not fixed on the command line are open",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description="Spark-integrated distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("--config", "-c", default=None, help="named config YAML, layered on conf/base.yaml")
        cmd.add_argument("--base", default=None, help="base config (default: base.yaml beside --config)")
        cmd.add_argument("--log-level", default="INFO", help="driver log level (default INFO)")
        cmd.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
        if name == "score":
            cmd.add_argument("--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID")
            cmd.add_argument("--input", required=True, help="Parquet path or table name")
            cmd.add_argument("--output", required=True,
                             help="output Parquet folder (must not exist unless score.overwrite=true); with "
                                  "--output-format delta a Delta table's folder or URL, with iceberg namespace.table "
                                  "in the catalog data.iceberg")
            cmd.add_argument("--output-format", choices=("parquet", "delta", "iceberg"), default=None,
                             help="score.output_format: a Parquet folder, or a Delta/Iceberg table the predictions "
                                  "are appended to in one commit, with the model URI and version as columns")
        if name == "tune":
            cmd.add_argument("--trials", type=int, default=None, help="trials in the study (default tune.trials); "
                             "an interrupted study runs only the ones still missing")
        if name == "plan":
            cmd.add_argument("--hosts", type=int, required=True, help="worker hosts of the assumed cluster")
            cmd.add_argument("--link-gbit", type=float, required=True, help="each host's link, Gbit/s each way")
            cmd.add_argument("--ranks-per-host", type=int, default=1, help="training ranks on each host (default 1)")
            cmd.add_argument("--driver-link-gbit", type=float, default=None,
                             help="the driver's link, Gbit/s (default: --link-gbit)")
            cmd.add_argument("--param-mb", type=float, default=None,
                             help="the model's fp32 parameters in MB (default: the config's model on its shard set)")
            cmd.add_argument("--compute-ms", type=float, default=None,
                             help="a step's forward + backward in ms (default: timed, or estimated from FLOPs, here)")
        if name in ("train", "run"):
            cmd.add_argument("--resume", action="store_true",
                             help="continue from the newest checkpoint in train.checkpoint_dir (same shards, "
                                  "model and parallelism), logging into the same MLflow run")
    return parser


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted. Notebooks and test runners swap
    sys.stderr; a handler bound to the old object would write to a closed stream for the rest of the
    process (and print a traceback per log line, from every PS thread)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always wins
        pass


def configure_logging(level: str) -> None:
    # force: under spark-submit the root logger already has a stdout handler; the CLI owns the process.
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[_CurrentStderrHandler()],
                        force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("py4j", "urllib3", "alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_command(command: str, config: Optional[str], overrides: Sequence[str], base: Optional[str] = None,
                resume: bool = False, model: Optional[str] = None, input: Optional[str] = None,
                output: Optional[str] = None, trials: Optional[int] = None, assumed=None):
    """Load the config, get the Spark session and run one step; returns what the step returned."""
    from pipeline import steps
    from pipeline.config import load
    from pipeline.session import get_or_create_spark

    cfg = load(config, overrides, base=base)
    if command == "plan":  # no Spark: a table for a cluster that need not exist yet
        return steps.plan(cfg, assumed, overrides)
    spark = get_or_create_spark(cfg.spark)
    if command == "generate":
        return steps.generate(spark, cfg)
    if command == "etl":
        return steps.etl(spark, cfg)
    if command == "train":
        return steps.train(spark, cfg, resume=resume)
    if command == "evaluate":
        return steps.evaluate(spark, cfg)
    if command == "promote":
        return steps.promote(spark, cfg)
    if command == "score":
        from pipeline.score import score

        return score(spark, cfg, model, input, output)
    if command == "workflow":
        from pipeline.workflow import run_workflow

        return run_workflow(spark, cfg)
    if command == "tune":
        from pipeline.tune import tune

        return tune(spark, cfg, trials)
    return steps.run_all(spark, cfg, resume=resume)


def _report(command: str, outcome) -> None:
    if command == "plan":
        print(outcome.table())
        print(f"pick: {outcome.pick.name} ({outcome.predicted.step_s * 1e3:.2f} ms a step predicted)")
        return
    if command == "score":
        print(f"scored {outcome.input_rows} rows with {outcome.model_uri} (run {outcome.run_id}) -> {outcome.output}")
        print(f"scored={outcome.scored_rows} invalid={outcome.invalid_rows} {outcome.invalid_by_column} "
              f"written={outcome.written_rows} rows/s={outcome.rows_per_s:.0f}")
        return
    if command == "promote":
        print(f"model version {outcome.version}: {outcome.alias} ({outcome.reason})")
        return
    if command == "workflow":
        print(f"workflow: {outcome.reason}")
        if outcome.run_id:
            print(f"mlflow run id: {outcome.run_id}")
            print("test metrics: " + json.dumps({k: round(v, 4) for k, v in outcome.test_metrics.items()}))
        return
    if command == "tune":
        print(f"study {outcome.study}: {outcome.trials} trials ({outcome.pruned} pruned) in {outcome.storage}")
        print(f"mlflow parent run id: {outcome.parent_run_id}")
        print(f"best: {outcome.best_value:.4f} with {json.dumps(outcome.best_params)} (run {outcome.best_run_id})")
        print(f"best config: {outcome.best_config}")
        if outcome.model_version:
            print(f"registered model version: {outcome.model_version}")
        return
    if command == "generate":
        print(f"synthetic data: {outcome}")
        return
    if command == "etl":
        print(f"shard set: {outcome.root}")
        print("rows: " + ", ".join(f"{k}={v.rows}" for k, v in outcome.splits.items()))
        print(f"fingerprint: {outcome.fingerprint}")
        return
    if getattr(outcome, "trained_on", None):
        print(f"trained on: {outcome.trained_on}")
    print(f"mlflow run id: {outcome.run_id}")
    print(f"tracking uri: {outcome.tracking_uri}")
    if outcome.model_uri:
        print(f"model: {outcome.model_uri}")
    if outcome.test_metrics:
        print("test metrics: " + json.dumps({k: round(v, 4) for k, v in outcome.test_metrics.items()}))


def _assumed(args):
    if args.command != "plan":
        return None
    if args.hosts < 1 or args.ranks_per_host < 1 or args.link_gbit <= 0:
        raise SystemExit("shardline plan: --hosts and --ranks-per-host must be >= 1 and --link-gbit > 0")
    return {"hosts": args.hosts, "link_gbit": args.link_gbit, "ranks_per_host": args.ranks_per_host,
            "driver_link_gbit": args.driver_link_gbit, "param_mb": args.param_mb, "compute_ms": args.compute_ms}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        overrides = args.overrides + ([f"score.output_format={args.output_format}"]
                                      if getattr(args, "output_format", None) else [])
        outcome = run_command(args.command, args.config, overrides, args.base,
                              resume=getattr(args, "resume", False), model=getattr(args, "model", None),
                              input=getattr(args, "input", None), output=getattr(args, "output", None),
                              trials=getattr(args, "trials", None), assumed=_assumed(args))
    except ShardlineError as exc:
        log.error("%s", exc)
        print(f"shardline {args.command} failed: {exc}", file=sys.stderr)
        return 2
    _report(args.command, outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
