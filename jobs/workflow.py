"""spark-submit entry point: the workflow step. Usage: spark-submit jobs/workflow.py --config conf/<name>.yaml [key=value ...]"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["workflow", *sys.argv[1:]]))
