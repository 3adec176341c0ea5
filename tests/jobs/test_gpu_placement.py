"""GPU placement tested the way Spark tests resource scheduling: a fake GPU discovery script on a
`local-cluster`, no real GPU. Each barrier task must train on the GPU Spark assigned it (and, with no CUDA
here, say so and fall back to the CPU)."""
import os
import re
import stat

import pytest


@pytest.mark.slow
def test_each_rank_takes_the_gpu_spark_assigned_it(submit_pipeline, tmp_path):
    script = tmp_path / "discover_gpus.sh"
    script.write_text('#!/bin/bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    proc, _ = submit_pipeline(
        "local-cluster[1,2,1024]",  # one executor with 2 cores and the 2 fake GPUs: one GPU per task
        "--conf", "spark.executor.memory=768m",
        "--conf", f"spark.worker.resource.gpu.discoveryScript={script}",
        "--conf", "spark.worker.resource.gpu.amount=2",
        "--conf", "spark.executor.resource.gpu.amount=2",
        "--conf", "spark.task.resource.gpu.amount=1",
        overrides=["train.epochs=1", "tracking.log_model=false"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    placement = re.search(r"ranks ran in 0@\S+ \((\w+), gpu (\d)\), 1@\S+ \((\w+), gpu (\d)\)", output)
    assert placement, output[-3000:]
    device0, gpu0, device1, gpu1 = placement.groups()
    assert {gpu0, gpu1} == {"0", "1"}  # each task got its own GPU address from Spark
    assert device0 == device1 == "cpu"  # and, without CUDA in this sandbox, trained on the CPU
