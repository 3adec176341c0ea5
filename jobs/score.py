"""spark-submit entry point: batch scoring with a tracked model.

Usage: spark-submit jobs/score.py --config conf/digits.yaml --model models:/NAME@champion \
           --input /data/rows.parquet|db.table --output /data/predictions [score.invalid_rows=keep_null ...]

Calls pipeline.score.score directly (the same function `shardline score` runs). Exit code 2 on a
shardline error (bad model URI, missing columns, rejected rows, existing output), with the reason on stderr.
"""
import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jobs/score.py", description="score a Parquet path or table with a "
                                     "tracked shardline model; writes Parquet predictions atomically")
    parser.add_argument("--config", "-c", default=None, help="named config YAML, layered on conf/base.yaml")
    parser.add_argument("--base", default=None, help="base config (default: base.yaml beside --config)")
    parser.add_argument("--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID")
    parser.add_argument("--input", required=True, help="Parquet path or table name")
    parser.add_argument("--output", required=True, help="output Parquet folder (must not exist unless "
                                                        "score.overwrite=true)")
    parser.add_argument("--output-format", choices=["parquet", "delta", "iceberg"], default=None,
                        help="parquet (a new folder), or append to a Delta table (--output: its folder or URL) or an "
                             "Iceberg table (--output: namespace.table in the catalog data.iceberg)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    args = parser.parse_args(argv)

    from pipeline.cli import configure_logging
    from pipeline.config import load
    from pipeline.errors import ShardlineError
    from pipeline.score import score
    from pipeline.session import get_or_create_spark

    configure_logging(args.log_level)
    try:
        overrides = list(args.overrides) + ([f"score.output_format={args.output_format}"] if args.output_format else [])
        cfg = load(args.config, overrides, base=args.base)
        spark = get_or_create_spark(cfg.spark)
        result = score(spark, cfg, args.model, args.input, args.output)
    except ShardlineError as exc:
        print(f"shardline score failed: {exc}", file=sys.stderr)
        return 2
    print(f"scored {result.input_rows} rows with {result.model_uri} (run {result.run_id}) -> {result.output}")
    print(json.dumps({"input_rows": result.input_rows, "scored_rows": result.scored_rows,
                      "invalid_rows": result.invalid_rows, "invalid_by_column": result.invalid_by_column,
                      "written_rows": result.written_rows, "seconds": round(result.seconds, 2),
                      "rows_per_s": round(result.rows_per_s, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
