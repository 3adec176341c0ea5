"""The typed configuration schema: every key, its type, its default and its allowed range.

Models are frozen and reject unknown keys, so a typo in a YAML file or an override fails at load time
with the key's dotted name instead of being silently ignored.
"""
from __future__ import annotations

import re
import typing
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from pipeline.config.auto import AutoConfig
from pipeline.config.faults import FaultsConfig
from pipeline.config.features import FeatureEntry
from pipeline.config.loss import LossFields
from pipeline.config.ps_options import PSConfig
from pipeline.config.section import SEED as _SEED
from pipeline.config.score import ScoreConfig
from pipeline.config.section import Section as _Section
from pipeline.config.sources import ClicksConfig, IcebergConfig, SyntheticConfig, table_pin_problem
from pipeline.config.train_options import DivergenceConfig, EarlyStoppingConfig, ScheduleConfig, check_combinations
from pipeline.config.tune import TuneConfig

class SparkConfig(_Section):
    """How the embedded session is built. Ignored when a SparkSession already exists (spark-submit)."""

    # the Spark master: local[N], local-cluster[...], spark://, yarn, k8s://, or sc://host:port for Spark Connect
    master: str = Field("local[2]", min_length=1)
    app_name: str = Field("shardline", min_length=1)  # the Spark application's name
    # Extra Spark properties for the embedded session; values are strings as in spark-defaults.conf.
    conf: dict[str, str] = Field(default_factory=dict)


class SplitConfig(_Section):
    """Deterministic split fractions: a row's split is a function of the hash of its id and the seed."""

    train: float = Field(0.7, gt=0, lt=1)  # fraction of rows in the train split (by a hash of the row id)
    # fraction in the validation split (per-epoch val_loss / val_accuracy; 0 turns it off)
    validation: float = Field(0.15, ge=0, lt=1)
    test: float = Field(0.15, gt=0, lt=1)  # fraction in the test split (evaluation after training)
    seed: int = Field(42, **_SEED)  # the split hash's seed

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> "SplitConfig":
        total = self.train + self.validation + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"split fractions must sum to 1 (train + validation + test = {total:g})")
        return self


class DataConfig(_Section):
    """Where the data comes from and how it is prepared."""

    # where rows come from: a built-in data set (digits, digits_images, synthetic, clicks), your csv/parquet
    # path, a catalog table or view (data.source=table, data.path=its name), or a lakehouse table read at a
    # pinned version: delta (data.path: the table's folder or URL) or iceberg (data.path: namespace.table in
    # the catalog data.iceberg); both need the extra shardline[delta] / shardline[iceberg].
    source: Literal["digits", "digits_images", "csv", "parquet", "table", "synthetic", "clicks", "delta",
                    "iceberg"] = "digits"
    # Input path for csv/parquet/delta, the table or view name for table, the identifier for iceberg; for the
    # built-in sources, where the raw Parquet data is landed
    # (default: workdir/raw/digits, workdir/raw/digits_images, workdir/raw/synthetic-<spec>, workdir/raw/clicks-<spec>).
    path: Optional[str] = Field(None, min_length=1)
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    clicks: ClicksConfig = Field(default_factory=ClicksConfig)
    # delta: the table version to read; null: the current one, resolved once when the ETL starts (a commit
    # made during the ETL is not read).
    version: Optional[int] = Field(None, ge=0)
    # iceberg: the snapshot to read; null: the current one, resolved once when the ETL starts.
    snapshot_id: Optional[int] = None
    # delta/iceberg: the version current at this time (ISO 8601; UTC where no offset is given).
    timestamp: Optional[str] = Field(None, min_length=1)
    iceberg: IcebergConfig = Field(default_factory=IcebergConfig)
    # Training loader backend: arrow (shardline's streaming row-group reader) or petastorm (optional
    # extra `shardline[petastorm]`, needs pyarrow <= 14.0.2 and numpy < 2: the LTS stack).
    reader: Literal["arrow", "petastorm"] = "arrow"
    # Rows held by each rank's shuffle buffer; bounds the loader's memory whatever the shard size.
    shuffle_buffer_rows: int = Field(65_536, ge=1)
    # Shuffle row-group order and rows (within the buffer) every epoch, seeded by (train.seed, rank, epoch).
    shuffle: bool = True
    # Threads decoding row groups ahead of the shuffle buffer.
    reader_threads: int = Field(1, ge=1, le=32)
    # Each rank's part of the validation split is read row group by row group every epoch; it is kept in
    # memory between epochs only when it fits this many MiB (0: always read again). See docs/data.md.
    validation_cache_mb: float = Field(256.0, ge=0)
    # Feature columns; null means every column except the label and the id column (all numeric). Items are
    # column names (numeric) or typed entries {name, type: numeric|categorical|vector|image|text, ...}
    # (pipeline/config/features.py).
    features: Optional[list[typing.Union[str, FeatureEntry]]] = None
    label: str = Field("label", min_length=1)  # the label column
    # Column that identifies a row for the split hash; null hashes the row's feature and label values.
    id_column: Optional[str] = Field(None, min_length=1)
    # classification (class labels, cross-entropy by default) or regression (numeric target, MSE by default)
    task: Literal["classification", "regression"] = "classification"
    # Classification only: the label values, in class-index order (the model's output i is classes[i]).
    # Null learns the label set from the data (sorted; numbers numerically). When set, a row whose label is
    # not listed is an invalid row (handled by invalid_rows, counted under the label column).
    classes: Optional[list[str]] = Field(None, min_length=2, max_length=10_000)
    # drop: remove rows with null/NaN/inf or non-numeric values in features or label, or a label outside
    # data.classes (counts reported per column); reject: fail naming the column, the count and the fix.
    invalid_rows: Literal["drop", "reject"] = "drop"
    # standardize numeric features with train-split mean and std (each numeric entry may override)
    standardize: bool = True
    split: SplitConfig = Field(default_factory=SplitConfig)
    # Output directory of the shard set (default: workdir/shards/<name>).
    shards_dir: Optional[str] = Field(None, min_length=1)
    # CSV reader options (header, delimiter, ...).
    csv_options: dict[str, str] = Field(default_factory=lambda: {"header": "true"})

    @field_validator("features")
    @classmethod
    def _features_not_empty(cls, value: Optional[list]) -> Optional[list]:
        if value is not None:
            names = [v if isinstance(v, str) else v.name for v in value]
            if not value:
                raise ValueError("must list at least one column, or be null for 'all but the label'")
            if not all(names):
                raise ValueError("column names must not be empty")
            if len(set(names)) != len(names):
                raise ValueError("lists a column more than once")
        return value

    @property
    def feature_names(self) -> Optional[list[str]]:
        """The configured feature columns (names only), or None for 'all but the label'."""
        return None if self.features is None else [f if isinstance(f, str) else f.name for f in self.features]

    @field_validator("classes", mode="before")
    @classmethod
    def _classes_as_text(cls, value: Any) -> Any:
        # `data.classes=[0, 1, 2]` parses as integers; the classes are label values written as text.
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value

    @field_validator("classes")
    @classmethod
    def _classes_distinct(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None:
            if not all(value):
                raise ValueError("class names must not be empty")
            repeated = sorted({v for v in value if value.count(v) > 1})
            if repeated:
                raise ValueError(f"lists {repeated} more than once")
        return value

    @model_validator(mode="after")
    def _path_for_file_sources(self) -> "DataConfig":
        if self.source in ("csv", "parquet", "table", "delta", "iceberg") and not self.path:
            what = {"table": "the table's name (catalog.schema.table, or a view)", "delta": "the Delta table's folder "
                    "or URL", "iceberg": "the table's identifier (namespace.table) in the catalog data.iceberg"}
            raise ValueError(f"data.path is required when data.source is {self.source!r}: "
                             f"{what.get(self.source, 'the input')}")
        problem = table_pin_problem(self.source, self.version, self.snapshot_id, self.timestamp)
        if problem:
            raise ValueError(problem)
        if self.source in _GENERATED and self.path and "://" in self.path and not self.path.startswith("file://"):
            # A generated source is landed by this machine on its own disk; an object-store URL would be read
            # as a local folder named "s3:".
            raise ValueError(f"data.source={self.source!r} is generated on the driver's disk, so data.path must be "
                             f"a local folder, got {self.path!r}: land it once, copy the folder to the object "
                             "store, and train with data.source=parquet and data.path=<that URL>")
        if self.features is not None and self.label in self.feature_names:
            raise ValueError(f"data.features must not include the label column data.label={self.label!r}")
        if self.classes is not None and self.task != "classification":
            raise ValueError("data.classes is only for data.task=classification; remove it or set it to null")
        return self


_GENERATED = ("digits", "digits_images", "synthetic", "clicks")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ModelConfig(_Section, LossFields):
    """The model: a built-in kind or a user factory `package.module:function`; its loss keys (model.loss,
    class_weights, label_smoothing, huber_delta, standardize_target) are in pipeline/config/loss.py."""

    # mlp (= tabular: an embedding per categorical/text feature, concatenated with the numeric, vector and
    # flattened image features, then the hidden layers), logreg (the same input, one linear layer), cnn (a
    # small conv net over the image feature, then the hidden layers).
    kind: Literal["mlp", "tabular", "logreg", "cnn"] = "mlp"
    hidden: list[int] = Field(default_factory=lambda: [64])  # mlp/tabular hidden widths (cnn: its head)
    activation: Literal["relu", "tanh", "gelu"] = "relu"  # the hidden layers' activation
    dropout: float = Field(0.0, ge=0, lt=1)  # dropout probability after each hidden layer
    # Built-ins: a BatchNorm1d after each hidden linear layer (its running statistics are model state:
    # merged across replicas, checkpointed and served like the parameters).
    batch_norm: bool = False
    # "package.module:function" called as function(features=FeatureSet, num_outputs=..., **factory_kwargs)
    # returning an nn.Module whose forward takes the batch dict; a factory whose first parameter is
    # num_features is the classic form: it gets the numeric width and a tensor.
    factory: Optional[str] = None
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)  # keyword arguments passed to model.factory
    # Factories an artifact read back (a checkpoint for --resume, a model for `shardline score`, evaluate or
    # promotion) may name besides model.factory; any other is refused, never imported.
    allowed_factories: list[str] = Field(default_factory=list)

    @field_validator("allowed_factories")
    @classmethod
    def _allowed_format(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not _FACTORY.match(v)]
        if bad:
            raise ValueError(f"entries must look like 'package.module:function', got {bad}")
        return value

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


class ShardsConfig(_Section):
    """How shard files are laid out: the loader reads one row group at a time, so these bound its reads."""

    # Rows per Parquet row group (the loader's read and shuffle unit).
    rows_per_row_group: int = Field(65_536, ge=1)
    # Approximate size of one shard file; a large shard is split into several files.
    target_file_mb: float = Field(256, gt=0)


class ParallelismConfig(_Section):
    # Data-parallel replicas; each reads one train shard. Barrier tasks = data x pipeline.
    data: int = Field(2, ge=1, le=1024)
    # Pipeline (model-parallel) stages per replica: the model (an nn.Sequential, or a factory's list of
    # stage modules) is cut into this many contiguous stages, one per barrier task (GPipe schedule).
    pipeline: int = Field(1, ge=1, le=64)
    # Micro-batches per step with pipeline > 1 (fill-drain); more shrink the bubble, (P-1)/(M+P-1).
    micro_batches: int = Field(1, ge=1, le=1024)
    # Explicit cut: the layer indices where stages 1..pipeline-1 start; null balances by parameter count.
    cuts: Optional[list[int]] = None

    @model_validator(mode="after")
    def _cuts_match_stages(self) -> "ParallelismConfig":
        if self.cuts is not None and len(self.cuts) != self.pipeline - 1:
            raise ValueError(f"parallelism.cuts needs pipeline-1 = {self.pipeline - 1} layer indices "
                             f"(where stages 1..{self.pipeline - 1} start), got {len(self.cuts)}")
        return self

    @property
    def tasks(self) -> int:
        """Barrier tasks: one per (replica, stage)."""
        return self.data * self.pipeline


class TrainConfig(_Section):
    epochs: int = Field(10, ge=1)  # passes over the train split
    # Per-worker batch size; the global batch is batch_size * parallelism.data.
    batch_size: int = Field(32, ge=1)
    # sgd (with momentum) or adam, applied on the PS (or locally with allreduce)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)  # the learning rate (the peak rate when train.schedule warms up or decays)
    momentum: float = Field(0.9, ge=0, lt=1)  # SGD momentum (async: see ps.async_momentum)
    weight_decay: float = Field(0.0, ge=0)  # L2 weight decay of the optimizer
    seed: int = Field(0, **_SEED)  # seeds the model initialization and the loaders' shuffles
    # Batches each worker's loader prepares ahead in a background thread.
    prefetch: int = Field(2, ge=0, le=64)
    # Lines of each worker's log kept for the driver's error report.
    log_tail_lines: int = Field(40, ge=0, le=10_000)
    # How workers synchronize: `ps` (the driver's parameter server, ps.* modes) or `allreduce`
    # (torch.distributed between the tasks, DistributedDataParallel: gloo on CPU, nccl on GPUs); `auto`: the
    # measured cost model (pipeline/launch/strategy/) picks, among the strategies train.auto allows.
    backend: Literal["ps", "allreduce", "auto"] = "ps"
    auto: AutoConfig = Field(default_factory=AutoConfig)  # what backend/ps.mode/compression/placement auto may pick
    # allreduce on CPU with every rank on one host: DDP's buckets averaged through /dev/shm
    # (pipeline/worker/shm_allreduce.py) instead of gloo over TCP loopback; off: gloo always.
    allreduce_shared_memory: bool = True
    # Barrier attempts before giving up: after a failed attempt the driver keeps the PS and its state and
    # runs the barrier job again; workers resume at the server's step (Spark never retries a barrier
    # ResultStage itself).
    max_attempts: int = Field(3, ge=1, le=100)
    # Durable checkpoints (local path or any fsspec URL); default <workdir>/checkpoints/<name>.
    checkpoint_dir: Optional[str] = None
    # Where the trained model is saved (model.pt, last_run.json): a local path or an object-store URL
    # (s3://, gs://, abfss://); default <workdir>/models/<name>.
    model_dir: Optional[str] = Field(None, min_length=1)
    # Checkpoints during training: every checkpoint_every_s seconds (null: off) and/or every checkpoint_every
    # applied PS steps (0: off), whichever comes first; always at the end and after a failed attempt. The
    # newest keep_checkpoints are kept.
    checkpoint_every_s: Optional[float] = Field(180.0, gt=0)
    checkpoint_every: int = Field(0, ge=0)  # and/or every N applied PS steps (0: off), whichever comes first
    keep_checkpoints: int = Field(3, ge=1, le=1000)  # newest checkpoints kept; older ones are pruned
    # lr schedule, clip of the applied gradient's global norm, precision, early stopping, guard: train_options.py
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    clip_grad_norm: Optional[float] = Field(None, gt=0)  # clip each step to this global L2 norm (null: off)
    # fp32, or autocast bf16/fp16 for forward and backward (fp16 with a GradScaler, CUDA only)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    divergence: DivergenceConfig = Field(default_factory=DivergenceConfig)
    # Per-step timing breakdown (data wait, forward, backward, exchange parts, ...) in every epoch row
    # as time/*_ms; off: no extra clock reads in the step loop.
    profile: bool = False
    # Fewer task slots than parallelism.data: train with the slots there are if at least this many (a WARNING,
    # MLflow param parallelism.data_asked); null: fail instead (docs/operations.md, elastic resume).
    min_workers: Optional[int] = Field(None, ge=1, le=1024)


class TimeoutsConfig(_Section):
    """Waits a user tunes apart; each null takes ps.timeout_s. Every timeout error names its own key."""

    # Per-step parameter-server waits: a step's pushes from every rank, a pull, a rank's turn in ssp/average,
    # and rank 0's wait for its peers to finish when the PS runs in its task.
    step_s: Optional[float] = Field(None, gt=0)
    # Rendezvous: ranks connecting to the PS (the stage watchdog's connect deadline), the allreduce
    # process group, pipeline stage links being accepted.
    connect_s: Optional[float] = Field(None, gt=0)
    # Pipeline stage links: activations and activation gradients of one micro-batch.
    link_s: Optional[float] = Field(None, gt=0)
    # A rank the parameter server has not heard from for this long (no request in flight: not computing
    # a step, not waiting in one) is named in a WARNING with its host and what happens next, shown on the
    # progress bar and counted per rank as rank<r>/stall_s in the epoch metrics. Only a warning: the step
    # deadline (step_s) still decides when the attempt fails. Needs train.backend=ps.
    stall_s: float = Field(10.0, gt=0)
    # Before a retry, how long the driver waits for the barrier's task slots to be back (a lost executor's
    # replacement starting) before it shrinks the run (train.min_workers) or fails, naming the hosts that left.
    slots_s: float = Field(15.0, gt=0)


class TrackingConfig(_Section):
    # Null: $MLFLOW_TRACKING_URI, else an SQLite file under the workdir.
    uri: Optional[str] = Field(None, min_length=1)
    # the MLflow experiment (created if missing; an absolute workspace path on Databricks)
    experiment: str = Field("shardline", min_length=1)
    run_name: Optional[str] = Field(None, min_length=1)  # the MLflow run's name (null: MLflow picks one)
    log_model: bool = True  # log the served MLflow model (pyfunc) at the end of training
    # If set, the logged model is also registered under this name.
    registered_model: Optional[str] = Field(None, min_length=1)
    # Sample this process's machine (CPU, memory, disk, network; GPUs when present) into the training run
    # as system/* metrics every this many seconds; null turns it off.
    system_metrics_interval_s: Optional[float] = Field(10.0, gt=0)


class WorkflowConfig(_Section):
    """`shardline workflow`: incremental ETL over a date-partitioned source or the versions of a Delta/Iceberg
    table, training, promotion."""

    # data.path holds one folder per partition, named <partition_column>=<value> (Hive style). A Delta or
    # Iceberg source needs none: the rows appended since the last run are the new partition.
    partition_column: str = Field("date", min_length=1)
    # Test metric that decides promotion, and whether higher is better (accuracy) or lower (loss, rmse).
    metric: str = Field("accuracy", min_length=1)
    higher_is_better: bool = True  # whether a higher workflow.metric wins (accuracy) or a lower one (loss)
    # The new model becomes `champion` only if it beats the champion by more than this; else `challenger`.
    margin: float = 0.0
    # Start training from the champion's parameters (same model shape) instead of from scratch.
    warm_start: bool = False
    # What a run trains on: every prepared partition (all), or only the one this run prepared (new: the rows
    # appended since the last run; with warm_start, the champion is fine-tuned on them).
    train_on: Literal["all", "new"] = "all"
    # Where the processed-partition state lives; default <workdir>/workflow/<name>.
    state_dir: Optional[str] = Field(None, min_length=1)


class PipelineConfig(_Section):
    """The whole resolved configuration of one pipeline run."""

    # names the shard set, the model folder, checkpoints and the registered model (letters, digits, _ . -)
    name: str = Field("shardline", pattern=r"^[A-Za-z0-9_.-]+$")
    # Working directory for raw data, shards, and the default MLflow store.
    workdir: str = Field(".shardline", min_length=1)
    # The workdir (and every other local path) is a mount every host has (NFS, /dbfs): on a cluster whose
    # executors run on other hosts than the driver, local paths are refused unless this says so.
    workdir_on_every_host: bool = False
    spark: SparkConfig = Field(default_factory=SparkConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    shards: ShardsConfig = Field(default_factory=ShardsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    ps: PSConfig = Field(default_factory=PSConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)  # shardline tune (pipeline/tune.py)

    @model_validator(mode="after")
    def _pipeline_parallel_limits(self) -> "PipelineConfig":
        check_combinations(self)  # the train.* essentials' own limits
        if self.parallelism.pipeline > 1:
            if self.train.backend != "allreduce" and self.ps.mode not in ("sync", "auto"):
                raise ValueError(f"parallelism.pipeline > 1 needs ps.mode=sync (got {self.ps.mode}): the stages of "
                                 "one replica must apply the same step together")
            if self.ps.placement not in ("driver", "auto"):
                raise ValueError("parallelism.pipeline > 1 needs ps.placement=driver (one PS per stage, on the driver)")
            if self.ps.compression == "topk":
                raise ValueError("parallelism.pipeline > 1 does not support ps.compression=topk yet; use none/fp16/bf16")
            if self.data.reader == "petastorm" and self.data.reader_threads > 1:
                raise ValueError("parallelism.pipeline > 1 with data.reader=petastorm needs data.reader_threads=1: "
                                 "petastorm's thread pool returns row groups in completion order, so the first "
                                 "and last stage could see rows in different orders")
        return self
