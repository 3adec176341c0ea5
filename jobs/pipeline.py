"""spark-submit entry point: etl, train and evaluate in one MLflow run.

    spark-submit jobs/pipeline.py --config conf/digits.yaml [key.sub=value ...]
"""
import os
import sys

# This script shares its name with the library package, and Python puts the script's folder first on
# sys.path: drop that folder so `import pipeline` finds the library, not this file.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

from pipeline.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
