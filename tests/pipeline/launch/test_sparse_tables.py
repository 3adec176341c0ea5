"""ps.sparse end to end: the clicks example trains its categorical tables as sparse rows on the PS (local
Spark, 2 workers), evaluates with the trained rows, and refuses what cannot hold tables, naming the key."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from pipeline.config.loader import load
from pipeline.errors import ConfigError
from pipeline.launch.sparse_tables import check_supported

CLICKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "clicks.yaml")


def _cfg(tmp_path, *extra: str):
    return load(CLICKS, [f"workdir={tmp_path}", "data.clicks.rows=10000", "data.clicks.vocab=2000",
                         "data.clicks.big_vocab=20000", "train.epochs=2", "model.hidden=[64]",
                         "tracking.log_model=false", "parallelism.data=2", "ps.sparse.min_rows=50", *extra])


@pytest.mark.slow
def test_clicks_reach_their_auc_through_the_sparse_ps(spark, tmp_path):
    from pipeline import steps
    from pipeline.evaluate import evaluate
    from pipeline.models import build_model
    from pipeline.models.sparse_embedding import sparse_modules

    cfg = _cfg(tmp_path)
    manifest = steps.etl(spark, cfg)
    trained = steps.tracked_training(spark, cfg, manifest)
    spec = trained.result.spec
    modules = sparse_modules(build_model(spec))
    assert len(modules) == 26  # every categorical table of the example is a sparse table
    directory = spec.sparse["tables"]
    for module in modules:
        ids = np.load(os.path.join(directory, module.spec.name, "ids.npy"))
        assert 0 < len(ids) <= module.spec.num_rows and (np.diff(ids) > 0).all()
    auc = trained.outcome.test_metrics["roc_auc"]
    assert auc > 0.66, trained.outcome.test_metrics  # dense Adam on the same data: ~0.63, the teacher's ceiling ~0.75
    # The rows it was evaluated with are the trained ones: the initial rows score worse.
    untrained = dataclasses.replace(spec, sparse={k: v for k, v in spec.sparse.items() if k != "tables"})
    assert evaluate(spark, manifest, untrained, trained.result.parameters).metrics["roc_auc"] < auc - 0.02
    stats = trained.result.ps_stats["sparse"]
    assert stats["rejected_frames"] == 0 and stats["tables"]["c0"]["rows"] == len(
        np.load(os.path.join(directory, "c0", "ids.npy")))


@pytest.mark.parametrize("override, key", [("train.backend=allreduce", "train.backend"),
                                           ("ps.placement=task", "ps.placement"),
                                           ("ps.mode=average", "ps.mode"), ("ps.overlap=true", "ps.overlap")])
def test_what_cannot_hold_tables_is_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"{key}=.* cannot train sparse embedding tables"):
        check_supported(_cfg(tmp_path, override))
