#!/usr/bin/env bash
# Issue 17's multi-core figures on the `device` tool's machine (16 cores; no Java, no pyspark, no network)
# in one call, everything prepared here first:
#
#   bash bench/device_scaling.sh prepare   # here: the shard set (Spark ETL, 8 train shards) into .devdata/set8,
#                                          # the wheels that machine lacks (pydantic & co, cp312) into .whl/
#   device run: command "bash bench/device_scaling.sh run", carry [".devdata", ".whl"], timeout_s ~480
#
# `run` trains on the CPU (CUDA_VISIBLE_DEVICES empty), 1 torch thread per worker, with
# bench/_process_barrier.py as the barrier stage: scaling_bench at 1/4/8 workers (comm MLP, 4.4 MB; ps,
# allreduce, and the PS in --ps-shards shard processes), then step_profile_bench's per-step breakdown at 8
# workers. Logs and tables go to $OUT (./device-out where unset); the tables are printed last.
set -euo pipefail
cd "$(dirname "$0")/.."

prepare() {
  local py=".venv/bin/python"
  for ignored in /.devdata/ /.whl/; do
    grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
  done
  PYSPARK_PYTHON="$PWD/$py" PYSPARK_DRIVER_PYTHON="$PWD/$py" MLFLOW_DISABLE_TELEMETRY=true \
    "$py" bench/scaling_bench.py --workers 8 --write-shards "$PWD/.devdata/set8" --workdir /tmp/shardline-device-etl
  # The versions this project tests with (constraints/modern.txt), built for that machine's Python 3.12.
  local wheels=()
  for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions; do
    wheels+=("$(grep -iE "^${name//[-_]/[-_]}==" constraints/modern.txt)")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${wheels[@]}"
  du -sh .devdata .whl
}

run() {
  local out="${OUT:-$PWD/device-out}" py="${PYTHON:-python3}"
  mkdir -p "$out"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true CUDA_VISIBLE_DEVICES=
  (nproc; lscpu | grep -E "Model name|^CPU\(s\)"; "$py" -c "import torch; print('torch', torch.__version__)") \
    > "$out/host.txt" 2>&1 || true
  local rc=0
  timeout 330 "$py" bench/scaling_bench.py --launcher processes --shards .devdata/set8 --workers 4 8 --models comm \
    --backends ps allreduce ps-processes --ps-shards 4 --repeats 2 --workdir /tmp/shardline-device-scaling \
    > "$out/scaling.txt" 2> "$out/scaling.err" || rc=$?
  timeout 120 "$py" bench/step_profile_bench.py --launcher processes --shards .devdata/set8 --workers 8 \
    --hidden 1024 1024 --batch-size 256 --epochs 2 --backends ps-sync allreduce \
    --workdir /tmp/shardline-device-profile > "$out/profile.txt" 2> "$out/profile.err" || rc=$((rc ? rc : $?))
  cat "$out/host.txt"
  grep -E "round|Error" "$out/scaling.err" | tail -40 || true
  cat "$out/scaling.txt" "$out/profile.txt"
  return "$rc"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bash bench/device_scaling.sh prepare|run" >&2; exit 2 ;;
esac
