"""ps.overlap through the launcher on local Spark: the config's bucket size becomes the server's slices,
and the bucketed run lands on the parameters of the whole-vector run."""
import pytest
import torch

from pipeline.config import build
from pipeline.etl import run_etl
from pipeline.launch import train


@pytest.mark.slow
def test_bucketed_sync_training_gives_the_parameters_of_whole_pushes(spark, tmp_path):
    cfg = build({"name": "overlap", "workdir": str(tmp_path), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "train": {"epochs": 2, "batch_size": 64, "lr": 0.05, "momentum": 0.9},
                 "model": {"hidden": [32]}, "ps": {"timeout_s": 60}, "tracking": {"log_model": False}})
    manifest = run_etl(spark, cfg)
    # 64*32+32 + 32*10+10 = 2410 parameters, 9640 bytes: 4 KiB buckets are 3 slices.
    bucketed = train(spark, cfg.model_copy(update={"ps": cfg.ps.model_copy(update={"overlap": True,
                                                                                   "bucket_mb": 4 / 1024})}),
                     manifest)
    whole = train(spark, cfg.model_copy(update={"ps": cfg.ps.model_copy(update={"overlap": False})}), manifest)
    assert bucketed.ps_stats["shards"] == 3 and whole.ps_stats["shards"] == 1
    assert bucketed.steps == whole.steps > 0
    assert torch.allclose(bucketed.parameters, whole.parameters, rtol=0, atol=1e-6)
