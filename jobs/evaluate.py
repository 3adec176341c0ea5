"""spark-submit entry point: the evaluate step. Usage: spark-submit jobs/evaluate.py --config conf/digits.yaml [key=value ...]"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
