#!/usr/bin/env bash
# The GPU smoke check in one command (see bench/gpu_smoke.py): the `gpu`-marked unit tests, then 2-rank
# digits/digits_cnn runs on a local-cluster with Spark-assigned GPUs, PS and allreduce, bf16 autocast,
# asserting device placement and accuracy. Prints SKIP (exit 0) where torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYSPARK_PYTHON="${PYSPARK_PYTHON:-$PWD/.venv/bin/python}" \
       PYSPARK_DRIVER_PYTHON="${PYSPARK_DRIVER_PYTHON:-$PWD/.venv/bin/python}" MLFLOW_DISABLE_TELEMETRY=true
PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "SKIP: torch sees no CUDA device (torch.cuda.is_available() is False)"
  exit 0
fi
"$PY" -m pytest -q -m "gpu and not slow" -p no:cacheprovider tests
"$PY" bench/gpu_smoke.py "$@"
