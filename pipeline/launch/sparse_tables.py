"""Driver side of sparse embedding tables (``ps.sparse``): the server's tables for the run's model, and the
trained rows written next to the model when training ends.

The tables a run has are the ``ShardlineEmbedding`` modules of its model (the built-in tabular model's
big categorical embeddings with ``ps.sparse.min_rows``, or a user model's), found by building the model
once on the driver. When training ends their rows are read from the server and written as
``<workdir>/models/sparse_tables/<run>/<table>/{ids,rows}.npy``; the spec then names that directory, so
evaluation, scoring and the logged model look rows up there (``pipeline.models.sparse_embedding``).
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any, Optional

from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


def sparse_spec(cfg: PipelineConfig, spec: Any) -> Optional[Any]:
    """The run's SparseSpec (what each server shard builds its tables from), or None when its model has no
    sparse table."""
    from pipeline.models import build_model
    from pipeline.models.sparse_embedding import sparse_modules

    modules = sparse_modules(build_model(spec))
    if not modules:
        return None
    check_supported(cfg)
    s = cfg.ps.sparse
    where = "spread over the hosts' shards" if cfg.ps.placement == "hosts" else "beside the driver's shard 0"
    log.info("sparse tables on the parameter server (%s): %s (ps.sparse.optimizer=%s, lr=%g, %d row shards, "
             "%s rows)", where, ", ".join(f"{m.spec.name}[{m.spec.num_rows or 'unbounded'}x{m.spec.dim}]"
                                          for m in modules), s.optimizer, s.lr, s.row_shards, s.wire_dtype)
    return tables_spec(cfg, spec, modules)


def tables_spec(cfg: PipelineConfig, spec: Any, modules: list) -> Any:
    """The SparseSpec of ``modules`` (the model's sparse tables) under ps.sparse, unchecked (sparse_spec checks)."""
    from pipeline.ps.sparse.rowopt import RowOptimizerSpec
    from pipeline.ps.sparse.spec import SparseSpec
    from pipeline.ps.sparse.table import RowPolicy

    s = cfg.ps.sparse
    return SparseSpec(tuple(m.spec for m in modules), RowOptimizerSpec(s.optimizer, lr=s.lr), s.row_shards,
                      RowPolicy(s.admit_after, s.ttl_steps, s.max_rows), spec.sparse.get("wire_dtype", "fp32"))


def sparse_store(cfg: PipelineConfig, spec: Any, world_size: int) -> Optional[Any]:
    """The run's SparseStore of the driver's shard 0, or None when its model has no sparse table."""
    from pipeline.launch.plans import consistency

    tables = sparse_spec(cfg, spec)
    return None if tables is None else tables.build(consistency(cfg), world_size)


def check_supported(cfg: PipelineConfig) -> None:
    """Refuse, naming the key, what cannot hold sparse tables yet."""
    problems = {
        "train.backend": (cfg.train.backend != "ps", "allreduce would move whole tables; use train.backend=ps"),
        "ps.placement": (cfg.ps.placement == "task", "sparse tables live on the driver's PS or spread over the "
                                                     "hosts' shards; use ps.placement=driver or hosts"),
        "parallelism.pipeline": (cfg.parallelism.pipeline > 1, "pipeline stages are not supported with sparse "
                                                               "tables; use parallelism.pipeline=1"),
        "ps.overlap": (cfg.ps.overlap, "dense buckets would reach the server before the step's rows; set "
                                       "ps.overlap=false"),
        "ps.mode": (cfg.ps.mode == "average", "average has no gradients for rows; use sync, ssp or async"),
    }
    for key, (bad, fix) in problems.items():
        if bad:
            raise ConfigError(f"{key}={_value(cfg, key)!r} cannot train sparse embedding tables "
                              f"(ps.sparse.min_rows or a ShardlineEmbedding in the model): {fix}")


def _value(cfg: PipelineConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def with_trained_tables(cfg: PipelineConfig, spec: Any, server: Any) -> Any:
    """``spec`` naming the directory its trained rows were written to (``spec`` itself without tables)."""
    from pipeline.config.workdir import Workdir
    from pipeline.models.sparse_embedding import save_tables

    state = getattr(server, "state_dict", None)
    tables = state().get("sparse") if state is not None else None
    if not tables:
        return spec
    rows = {name: _table_rows(table) for name, table in tables.items()}
    where = Workdir.of(cfg)
    models = where.models
    if isinstance(models, str):  # train.model_dir on an object store: executors memory-map tables from a disk
        models = Path(where.path).absolute() / "models" / cfg.name
        log.info("train.model_dir=%s is an object store; the sparse tables' rows are memory-mapped from a disk, "
                 "so they go to %s (the executors need it: local Spark, or workdir_on_every_host)",
                 cfg.train.model_dir, models)
    directory = str(models / "sparse_tables" / uuid.uuid4().hex[:12])
    save_tables(rows, directory)
    log.info("sparse tables written to %s: %s", directory,
             ", ".join(f"{name} {len(ids)} rows" for name, (ids, _) in rows.items()))
    return dataclasses.replace(spec, sparse={**spec.sparse, "tables": directory})


def _table_rows(table: dict) -> tuple[Any, Any]:
    import numpy as np
    import torch

    shards = table["shards"]
    ids = torch.cat([s["ids"] for s in shards]).numpy()
    rows = torch.cat([s["rows"] for s in shards]).numpy()
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[order]

