"""The typed configuration schema: every key, its type, its default and its allowed range.

Models are frozen and reject unknown keys, so a typo in a YAML file or an override fails at load time
with the key's dotted name instead of being silently ignored.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class SparkConfig(_Section):
    """How the embedded session is built. Ignored when a SparkSession already exists (spark-submit)."""

    master: str = "local[2]"
    app_name: str = "shardline"
    # Extra Spark properties for the embedded session; values are strings as in spark-defaults.conf.
    conf: dict[str, str] = Field(default_factory=dict)


class SplitConfig(_Section):
    """Deterministic split fractions: a row's split is a function of the hash of its id and the seed."""

    train: float = Field(0.7, gt=0, lt=1)
    validation: float = Field(0.15, ge=0, lt=1)
    test: float = Field(0.15, gt=0, lt=1)
    seed: int = 42

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> "SplitConfig":
        total = self.train + self.validation + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"split fractions must sum to 1 (train + validation + test = {total:g})")
        return self


class DataConfig(_Section):
    """Where the data comes from and how it is prepared."""

    source: Literal["digits", "csv", "parquet"] = "digits"
    # Input path for csv/parquet; for digits, where the raw Parquet copy is landed (default: workdir/raw/digits).
    path: Optional[str] = None
    # Feature columns; null means every column except the label and the id column.
    features: Optional[list[str]] = None
    label: str = "label"
    # Column that identifies a row for the split hash; null hashes the row's feature and label values.
    id_column: Optional[str] = None
    task: Literal["classification", "regression"] = "classification"
    # drop: remove rows with null/NaN/inf in features or label (count reported); reject: fail naming the count.
    invalid_rows: Literal["drop", "reject"] = "drop"
    standardize: bool = True
    split: SplitConfig = Field(default_factory=SplitConfig)
    # Output directory of the shard set (default: workdir/shards/<name>).
    shards_dir: Optional[str] = None
    # CSV reader options (header, delimiter, ...).
    csv_options: dict[str, str] = Field(default_factory=lambda: {"header": "true"})

    @field_validator("features")
    @classmethod
    def _features_not_empty(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None:
            if not value:
                raise ValueError("must list at least one column, or be null for 'all but the label'")
            if len(set(value)) != len(value):
                raise ValueError("lists a column more than once")
        return value

    @model_validator(mode="after")
    def _path_for_file_sources(self) -> "DataConfig":
        if self.source in ("csv", "parquet") and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ModelConfig(_Section):
    """The model: a built-in kind or a user factory `package.module:function`."""

    kind: Literal["mlp", "logreg"] = "mlp"
    hidden: list[int] = Field(default_factory=lambda: [64])
    activation: Literal["relu", "tanh", "gelu"] = "relu"
    dropout: float = Field(0.0, ge=0, lt=1)
    # "package.module:function" called as function(num_features=..., num_outputs=..., **factory_kwargs).
    factory: Optional[str] = None
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("hidden")
    @classmethod
    def _positive_widths(cls, value: list[int]) -> list[int]:
        if any(width <= 0 for width in value):
            raise ValueError(f"layer widths must be positive, got {value}")
        return value

    @field_validator("factory")
    @classmethod
    def _factory_format(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not _FACTORY.match(value):
            raise ValueError(f"must look like 'package.module:function', got {value!r}")
        return value


class ParallelismConfig(_Section):
    # Number of data-parallel workers = barrier tasks.
    data: int = Field(2, ge=1, le=1024)


class TrainConfig(_Section):
    epochs: int = Field(10, ge=1)
    # Per-worker batch size; the global batch is batch_size * parallelism.data.
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 0
    # Batches each worker's loader prepares ahead in a background thread.
    prefetch: int = Field(2, ge=0, le=64)
    # Lines of each worker's log kept for the driver's error report.
    log_tail_lines: int = Field(40, ge=0, le=10_000)


class PSConfig(_Section):
    mode: Literal["sync"] = "sync"
    # Address the PS binds to; null means spark.driver.host (never 0.0.0.0 unless set explicitly).
    host: Optional[str] = None
    # Deadline of every PS wait (a step's gradients from all workers, a pull, a connect).
    timeout_s: float = Field(120.0, gt=0)


class TrackingConfig(_Section):
    # Null: $MLFLOW_TRACKING_URI, else an SQLite file under the workdir.
    uri: Optional[str] = None
    experiment: str = "shardline"
    run_name: Optional[str] = None
    log_model: bool = True
    # If set, the logged model is also registered under this name.
    registered_model: Optional[str] = None


class FaultsConfig(_Section):
    """Fault injection for tests and drills; everything off by default."""

    # Rank that raises InjectedFault once it reaches fail_step.
    fail_rank: Optional[int] = Field(None, ge=0)
    fail_step: int = Field(0, ge=0)


class PipelineConfig(_Section):
    """The whole resolved configuration of one pipeline run."""

    name: str = Field("shardline", pattern=r"^[A-Za-z0-9_.-]+$")
    # Working directory for raw data, shards, and the default MLflow store.
    workdir: str = ".shardline"
    spark: SparkConfig = Field(default_factory=SparkConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    ps: PSConfig = Field(default_factory=PSConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
