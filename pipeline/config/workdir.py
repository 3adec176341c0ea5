"""The layout under `cfg.workdir`, in one place: `Workdir.of(cfg)` names every folder a run reads or writes.

    <workdir>/raw/digits                        landed digits (data.source=digits; data.path overrides)
    <workdir>/raw/digits_images                 landed digits as PNG bytes (data.source=digits_images; data.path overrides)
    <workdir>/raw/synthetic-<spec>              landed synthetic data (data.source=synthetic; data.path overrides)
    <workdir>/raw/clicks-<spec>                 landed synthetic click log (data.source=clicks; data.path overrides)
    <workdir>/shards/<name>                     the shard set (data.shards_dir overrides)
    <workdir>/shards/<name>/<column>=<value>    one workflow partition's shard set
    <workdir>/models/<name>                     the last trained model (model.pt, last_run.json; train.model_dir overrides)
    <workdir>/checkpoints/<name>                durable checkpoints (train.checkpoint_dir overrides)
    <workdir>/workflow/<name>                   the workflow's processed-partition state (workflow.state_dir overrides)
    <workdir>/mlflow.db                         the default tracking store (tracking.uri, $MLFLOW_TRACKING_URI override)
    <workdir>/spark_ml/<name>/input             ShardlineEstimator's Parquet copy of the fitted frame
    .<folder>.staging-<hex12>                   a shard set or synthetic data being written (hidden_sibling)
    .<folder>.retired-<hex12>                   the shard set being replaced, until the new one is in place
    .digits.tmp-<hex8>                          the digits (or digits_images) being landed

Every path is exactly what the modules computed before this one existed, since existing workdirs and
their state files name them: so the workdir as written is kept (`path`), and each path is derived the way
its consumer always derived it. That is not uniform: shards, models, workflow state and raw data stay
relative when the workdir is relative (resolved against the cwd when used); checkpoints are made
absolute with `os.path.abspath` (they are handed to executors); the SQLite store resolves `~` and
symlinks (a `sqlite:///` URI must be absolute); the estimator's folder resolves symlinks. So a workdir
of `~/w` has its store in $HOME/w but everything else in ./~/w, as before; making that uniform would
move existing data, and is a separate, announced change.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.config.schema import DataConfig, PipelineConfig
from pipeline.storage import is_remote, join

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
SQLITE_PREFIX = "sqlite:///"
TRACKING_DB = "mlflow.db"


def raw_digits(data: DataConfig, workdir: str | os.PathLike) -> Path:
    """Where the digits source is landed. A plain function too: the ETL's readers get data + workdir."""
    return Path(data.path) if data.path else Path(workdir) / "raw" / "digits"


def raw_synthetic(data: DataConfig, workdir: str | os.PathLike) -> Path:
    """Where the synthetic source is landed: one folder per spec, so another spec never reuses it."""
    if data.path:
        return Path(data.path)
    s = data.synthetic
    kind = f"c{s.classes}" if data.task == "classification" else "regression"
    return Path(workdir) / "raw" / f"synthetic-{s.rows}x{s.features}-{kind}-s{s.seed}"


def raw_digits_images(data: DataConfig, workdir: str | os.PathLike) -> Path:
    """Where the digits_images source (the digits as PNG bytes) is landed."""
    return Path(data.path) if data.path else Path(workdir) / "raw" / "digits_images"


def raw_clicks(data: DataConfig, workdir: str | os.PathLike) -> Path:
    """Where the clicks source is landed. The name carries the shape and seed; the rest of the spec
    (vocabularies, skew, nulls) is checked against the folder's spec file, which regenerates it in place."""
    if data.path:
        return Path(data.path)
    c = data.clicks
    return Path(workdir) / "raw" / f"clicks-{c.rows}x{c.numeric}n{c.categorical}c-s{c.seed}"


def tracking_db(workdir: str | os.PathLike) -> Path:
    """The default SQLite tracking store's file (absolute, `~` and symlinks resolved)."""
    return Path(workdir).expanduser().resolve() / TRACKING_DB


def default_tracking_uri(workdir: str | os.PathLike) -> str:
    return f"{SQLITE_PREFIX}{tracking_db(workdir)}"


def pick_tracking_uri(configured: Optional[str], workdir: str | os.PathLike) -> tuple[str, str]:
    """(URI, where it came from: "config", the env variable's name, or "default").

    tracking.uri > $MLFLOW_TRACKING_URI > the workdir's SQLite file; blank values count as unset. The
    environment is read on each call, as it always was, so a variable set after loading still counts.
    """
    if configured and configured.strip():
        return configured.strip(), "config"
    from_env = os.environ.get(TRACKING_URI_ENV, "").strip()
    if from_env:
        return from_env, TRACKING_URI_ENV
    return default_tracking_uri(workdir), "default"


def hidden_sibling(target: str | os.PathLike, kind: str = "staging", hex_chars: int = 12) -> Path:
    """A fresh hidden folder beside `target` (`.<name>.<kind>-<hex>`), for building a replacement of it
    and renaming it into place: same filesystem, so the rename is atomic, and the leading dot keeps
    Spark's file index and the workflow's partition discovery from ever listing a half-written copy."""
    target = Path(target)
    return target.parent / f".{target.name}.{kind}-{uuid.uuid4().hex[:hex_chars]}"


@dataclass(frozen=True)
class Workdir:
    """Every path of one config under its workdir (or wherever a config key moved it)."""

    path: str  # cfg.workdir as written
    name: str  # cfg.name
    data: DataConfig
    checkpoint_dir: Optional[str] = None  # train.checkpoint_dir
    state_dir: Optional[str] = None  # workflow.state_dir
    configured_tracking_uri: Optional[str] = None  # tracking.uri
    model_dir: Optional[str] = None  # train.model_dir

    @classmethod
    def of(cls, cfg: PipelineConfig) -> "Workdir":
        return cls(cfg.workdir, cfg.name, cfg.data, cfg.train.checkpoint_dir, cfg.workflow.state_dir,
                   cfg.tracking.uri, model_dir=cfg.train.model_dir)

    @property
    def root(self) -> Path:
        """The workdir, absolute (normalized like `os.path.abspath`; symlinks kept)."""
        return Path(os.path.abspath(self.path))

    @property
    def raw(self) -> Path:
        return Path(self.path) / "raw"

    @property
    def raw_digits(self) -> Path:
        return raw_digits(self.data, self.path)

    @property
    def raw_synthetic(self) -> Path:
        return raw_synthetic(self.data, self.path)

    @property
    def raw_digits_images(self) -> Path:
        return raw_digits_images(self.data, self.path)

    @property
    def raw_clicks(self) -> Path:
        return raw_clicks(self.data, self.path)

    @property
    def shards(self) -> Path | str:
        """This config's shard set: data.shards_dir, else <workdir>/shards/<name>. An object-store URL
        (s3://...) stays a str: a Path would fold its '//'."""
        if self.data.shards_dir and is_remote(self.data.shards_dir):
            return self.data.shards_dir.rstrip("/")
        return Path(self.data.shards_dir) if self.data.shards_dir else Path(self.path) / "shards" / self.name

    def shard_partition(self, column: str, value: str) -> Path | str:
        """The shard set of one workflow partition, inside the shard set the partitions merge into."""
        return join(self.shards, f"{column}={value}") if is_remote(self.shards) else self.shards / f"{column}={value}"

    @property
    def models(self) -> Path | str:
        """train.model_dir (an object-store URL stays a str), else <workdir>/models/<name>."""
        if self.model_dir:
            return self.model_dir.rstrip("/") if is_remote(self.model_dir) else Path(self.model_dir)
        return Path(self.path) / "models" / self.name

    @property
    def checkpoints(self) -> str:
        """train.checkpoint_dir as written (it may be an fsspec URL, hence a str), else the absolute
        <workdir>/checkpoints/<name>: executors and a task-placed PS open it from other cwds."""
        return self.checkpoint_dir or os.path.join(os.path.abspath(self.path), "checkpoints", self.name)

    @property
    def workflow_state(self) -> Path:
        return Path(self.state_dir or Path(self.path) / "workflow" / self.name)

    @property
    def tracking_db(self) -> Path:
        """The default tracking store's file; used only when neither tracking.uri nor the env sets one."""
        return tracking_db(self.path)

    @property
    def default_tracking_uri(self) -> str:
        return default_tracking_uri(self.path)

    @property
    def tracking_uri(self) -> str:
        """The URI runs are recorded at (tracking.uri > $MLFLOW_TRACKING_URI > tracking_db). Pure: the
        store's folder is created by `pipeline.tracking.resolve_tracking_uri`, which callers go through."""
        return pick_tracking_uri(self.configured_tracking_uri, self.path)[0]

    @property
    def spark_ml(self) -> Path:
        """ShardlineEstimator's run folder (symlinks resolved)."""
        return Path(self.path).resolve() / "spark_ml" / self.name

    @property
    def spark_ml_input(self) -> Path:
        return self.spark_ml / "input"
