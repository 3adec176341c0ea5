"""spark-submit entry point: the etl step. Usage: spark-submit jobs/etl.py --config conf/digits.yaml [key=value ...]"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["etl", *sys.argv[1:]]))
