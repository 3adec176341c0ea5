"""GPU smoke check: the CUDA path end to end on a real Spark standalone-in-a-box cluster.

    .venv/bin/python bench/gpu_smoke.py [--workdir /tmp/shardline-gpu-smoke] [--epochs 6]
    bench/gpu_smoke.sh            # the same, plus the `gpu`-marked unit tests

Spark's `local[N]` mode does not hand tasks GPU addresses, so this starts `local-cluster[1,2,4096]`: one
worker and one 2-core executor owning min(2, GPUs) GPUs (a discovery script lists torch's device indices;
one executor, because standalone workers on one host would each hand out address 0), and
`spark.task.resource.gpu.amount=1` (0.5 on a 1-GPU host: both ranks then share GPU 0).
Then, each with 2 ranks and `train.precision=bf16` (autocast on the GPU):

  digits (MLP)           train.backend=ps         (gradients to host in one copy, the driver's PS)
  digits (MLP)           train.backend=allreduce  (DDP over NCCL; needs 2 GPUs: two NCCL ranks may not share one)
  digits_cnn (images)    train.backend=ps

and asserts for every run: each rank trained on `cuda:<n>` of the GPU Spark assigned it (the row's `gpu`
address mapped through CUDA_VISIBLE_DEVICES), allreduce ranks on distinct GPUs, and the test accuracy
(evaluated in Spark) >= 0.9. Exits 0 and prints SKIP with the reason when torch sees no CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCURACY_BAR = 0.9


def _discovery_script(folder: str, count: int) -> str:
    path = os.path.join(folder, "gpus.sh")
    addresses = ",".join(f'"{i}"' for i in range(count))
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def _session(workdir: str, gpus: int):
    import pyspark
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    script = _discovery_script(workdir, gpus)
    owned = min(gpus, 2)
    return (SparkSession.builder.master("local-cluster[1,2,4096]").appName("shardline-gpu-smoke")
            .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.worker.resource.gpu.amount", str(owned))
            .config("spark.worker.resource.gpu.discoveryScript", script)
            .config("spark.executor.resource.gpu.amount", str(owned))
            .config("spark.executor.resource.gpu.discoveryScript", script)
            .config("spark.task.resource.gpu.amount", "1" if owned >= 2 else "0.5")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", REPO))
            .getOrCreate())


def _check(name: str, result, accuracy: float, backend: str) -> dict:
    from pipeline.worker.device import cuda_ordinal

    problems = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    for row in result.ranks:
        gpu, device = row.get("gpu"), row.get("device")
        if gpu is None:
            problems.append(f"rank {row['rank']}: Spark assigned no GPU")
            continue
        expected = cuda_ordinal(gpu, visible, torch.cuda.device_count())
        if device != f"cuda:{expected}":
            problems.append(f"rank {row['rank']}: trained on {device}, Spark assigned GPU {gpu} (cuda:{expected})")
    if backend == "allreduce" and len({r.get("device") for r in result.ranks}) != len(result.ranks):
        problems.append(f"allreduce ranks share a GPU: {[r.get('device') for r in result.ranks]}")
    if accuracy < ACCURACY_BAR:
        problems.append(f"test accuracy {accuracy:.3f} < {ACCURACY_BAR}")
    return {"run": name, "accuracy": round(accuracy, 4), "devices": [r.get("device") for r in result.ranks],
            "gpus": [r.get("gpu") for r in result.ranks], "problems": problems}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shardline-gpu-smoke"))
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device (torch.cuda.is_available() is False); nothing to check")
        return 0
    gpus = torch.cuda.device_count()
    os.makedirs(args.workdir, exist_ok=True)
    sys.path.insert(0, REPO)
    from pipeline.config import build
    from pipeline.etl import run_etl
    from pipeline.evaluate import evaluate
    from pipeline.launch import train

    runs = [("digits-ps", None, "ps"), ("digits-allreduce", None, "allreduce"), ("digits_cnn-ps", "digits_cnn", "ps")]
    spark = _session(args.workdir, gpus)
    reports = []
    try:
        for name, config, backend in runs:
            if backend == "allreduce" and gpus < 2:
                reports.append({"run": name, "skipped": f"needs 2 GPUs for 2 NCCL ranks, this host has {gpus}"})
                continue
            base = {"name": name, "workdir": os.path.join(args.workdir, name), "parallelism": {"data": 2},
                    "train": {"backend": backend, "epochs": args.epochs, "precision": "bf16", "batch_size": 32},
                    "tracking": {"log_model": False}, "ps": {"timeout_s": 120}}
            if config is None:
                base.update({"data": {"source": "digits"}, "model": {"hidden": [128, 64]}})
                cfg = build(base)
            else:
                from pipeline.config import load

                cfg = load(os.path.join(REPO, "conf", f"{config}.yaml"),
                           [f"name={name}", f"workdir={base['workdir']}", "parallelism.data=2",
                            f"train.backend={backend}", f"train.epochs={args.epochs}", "train.precision=bf16",
                            "tracking.log_model=false"])
            manifest = run_etl(spark, cfg)
            result = train(spark, cfg, manifest)
            accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
            reports.append(_check(name, result, accuracy, backend))
            print(json.dumps(reports[-1]), flush=True)
    finally:
        spark.stop()
    failed = [r for r in reports if r.get("problems")]
    print("GPU SMOKE " + ("FAILED" if failed else "OK") + ": " + json.dumps(reports))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
