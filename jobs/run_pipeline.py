"""spark-submit entry point: etl, train and evaluate in one MLflow run.

    spark-submit jobs/run_pipeline.py --config conf/digits.yaml [key.sub=value ...] [--resume]

(Not named pipeline.py: spark-submit puts this folder first on sys.path, and a jobs/pipeline.py would
shadow the library package for every job in the folder.)
"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
