"""spark-submit entry point: the promote step. Usage: spark-submit jobs/promote.py --config conf/<name>.yaml [key=value ...]"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["promote", *sys.argv[1:]]))
