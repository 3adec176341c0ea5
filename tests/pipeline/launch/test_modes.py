"""Every ps.mode (and top-k compression) trains the digits pipeline to the accuracy bar, on local Spark."""
import pytest
import torch

from pipeline.config import build
from pipeline.data import read_tensors
from pipeline.etl import run_etl
from pipeline.launch import train

ACCURACY_BAR = 0.93


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("modes")
    cfg = build({"name": "modes", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "train": {"epochs": 12, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
                 "model": {"hidden": [64]}, "ps": {"timeout_s": 60}})
    return cfg, run_etl(spark, cfg)


def _test_accuracy(result, manifest) -> float:
    x, y = read_tensors(manifest.files("test"), manifest.features_field, manifest.label_field,
                        manifest.num_features)
    with torch.no_grad():
        return float((result.model()(x).argmax(dim=1) == y).float().mean())


@pytest.mark.parametrize("ps", [
    {"mode": "async"},
    {"mode": "ssp", "staleness": 2},
    {"mode": "average", "sync_every": 4},
    {"mode": "sync", "compression": "topk", "topk_ratio": 0.05},
    {"mode": "sync", "compression": "bf16"},
], ids=["async", "ssp", "average", "sync-topk", "sync-bf16"])
def test_mode_reaches_the_accuracy_bar(spark, digits, ps):
    cfg, manifest = digits
    cfg = cfg.model_copy(update={"ps": cfg.ps.model_copy(update=ps)})
    result = train(spark, cfg, manifest)
    assert result.ps_stats["mode"] == ps["mode"]
    assert all(r["ok"] for r in result.ranks)
    assert {"wait_s", "staleness_max"} <= set(result.history[-1])
    assert _test_accuracy(result, manifest) >= ACCURACY_BAR
