"""bench/gpu_smoke.py: on a CUDA host it must pass (2 ranks, ps and allreduce, bf16, digits and images,
device placement and accuracy asserted); elsewhere it says SKIP and why, and exits 0."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _smoke(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, str(REPO / "bench" / "gpu_smoke.py"), "--workdir", str(tmp_path), *args],
                          capture_output=True, text=True, env=env, timeout=1800)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: test_the_smoke_passes_on_a_gpu runs")
def test_without_cuda_the_smoke_skips_with_the_reason(tmp_path):
    proc = _smoke(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("SKIP: torch sees no CUDA device")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_the_smoke_passes_on_a_gpu(tmp_path):
    proc = _smoke(tmp_path, "--epochs", "6")
    assert proc.returncode == 0 and "GPU SMOKE OK" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]
