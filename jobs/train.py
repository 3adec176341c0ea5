"""spark-submit entry point: the train step. Usage: spark-submit jobs/train.py --config conf/digits.yaml [key=value ...]"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
