"""spark-submit entry point: land the synthetic data set.

Usage: spark-submit jobs/generate.py --config conf/synthetic.yaml [data.synthetic.rows=5000000 ...]
"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
