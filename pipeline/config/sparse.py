"""``ps.sparse``: embedding tables kept on the parameter server as sparse rows (pipeline/ps/sparse), validated
at construction.

    ps:
      sparse:
        min_rows: 100000        # tabular: categorical features with at least this many rows go sparse
        optimizer: adagrad      # the tables' row-wise optimizer (dense parameters keep train.optimizer)
        lr: 0.05
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeline.config.section import Section


class SparseConfig(Section):
    # The built-in tabular model keeps each categorical feature whose table has at least min_rows rows
    # (vocabulary or hash_buckets) on the parameter server as sparse rows; 0: every embedding stays dense.
    min_rows: int = Field(0, ge=0)
    # The tables' row-wise optimizer on the server: sgd, adagrad, or adam with a step count per row.
    optimizer: Literal["sgd", "adagrad", "adam"] = "adagrad"
    # The tables' learning rate (the dense parameters keep train.lr).
    lr: float = Field(0.05, gt=0)
    # Standard deviation of a row's initial value, seeded by (table, id, train.seed): reproducible anywhere.
    init_std: float = Field(0.1, gt=0)
    # Row shards per table on the server (rows spread by a hash of the id).
    row_shards: int = Field(4, ge=1, le=1024)
    # How rows and row gradients travel: fp32, or fp16 (half the bytes; the server keeps fp32 rows).
    wire_dtype: Literal["fp32", "fp16"] = "fp32"
    # Admission: an id becomes a row at its admit_after-th touch (before: it reads as its initial row and its
    # gradients are dropped, counted); 1 admits on first touch.
    admit_after: int = Field(1, ge=1)
    # Eviction: rows unseen for ttl_steps applied steps are dropped (0: never).
    ttl_steps: int = Field(0, ge=0)
    # Eviction: at most max_rows rows per table, the least recently seen dropped first (0: no cap).
    max_rows: int = Field(0, ge=0)

    def model_options(self, seed: int) -> dict[str, Any]:
        """What the model spec carries (plain values): which tables go sparse and how they start."""
        if not self.min_rows:  # a user model's ShardlineEmbedding still travels as wire_dtype says
            return {} if self.wire_dtype == "fp32" else {"wire_dtype": self.wire_dtype}
        return {"min_rows": self.min_rows, "init_std": self.init_std, "seed": seed, "wire_dtype": self.wire_dtype}
