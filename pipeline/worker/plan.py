"""What one barrier task needs to train: nested frozen plain-value objects, built once on the driver from
the validated config (``pipeline.launch.plans``) and handed whole to the part that owns each piece —
the loader its ``LoaderPlan``, the fault hooks their ``FaultPlan``, a pipeline stage its ``StagePlan``.
They cross into the Spark task closure as they are (cloudpickle of frozen dataclasses): no dict round trip.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.data.assignment import Segment
from pipeline.models import ModelSpec
from pipeline.ps import OptimizerSpec
from pipeline.wire.deadline import CONNECT_KEY, LINK_KEY, STEP_KEY, Timeout


@dataclass(frozen=True)
class LoaderPlan:
    """The streaming loader's settings (``data.*``, ``train.prefetch``) and this shard's row-group sizes."""

    reader: str = "arrow"
    shuffle: bool = True
    shuffle_buffer_rows: int = 65_536
    reader_threads: int = 1
    prefetch: int = 2
    # Rows of each row group of each train file (from the manifest), so the loader plans without a read.
    row_group_rows: Optional[tuple[tuple[int, ...], ...]] = None
    # Arrow reader: the ranks sharing each epoch's row stream (train_files are all the train files), and
    # the segment of an epoch resumed on another world size (pipeline.data.assignment). None: the files
    # are this rank's own (petastorm).
    world: Optional[int] = None
    resumed: Optional[Segment] = None


@dataclass(frozen=True)
class FaultPlan:
    """The ``faults.*`` hooks of this attempt (all off unless the attempt is one they apply to)."""

    fail_rank: Optional[int] = None
    fail_step: int = 0
    fail_in_rendezvous: bool = False
    kill_rank: Optional[int] = None
    kill_step: int = 0
    delay_rank: Optional[int] = None
    delay_ms: float = 0.0
    delay_step: int = 0
    # Test hook: one rank sleeps slow_s before every step (e.g. to exercise ssp's staleness bound).
    slow_rank: Optional[int] = None
    slow_s: float = 0.0
    # faults.explode_*: the rank's loss times explode_factor at explode_step (the divergence guard's drill).
    explode_rank: Optional[int] = None
    explode_step: int = 0
    explode_factor: float = 1e6
    # faults.record_rows_dir: each applied step's row digests go to a JSON-lines file per rank (test hook).
    record_dir: Optional[str] = None


@dataclass(frozen=True)
class StagePlan:
    """Where a task sits in the data x pipeline grid (``parallelism.pipeline > 1``)."""

    stage: int
    stages: int
    replica: int
    replicas: int
    micro_batches: int = 1
    cuts: Optional[tuple[int, ...]] = None
    # This stage's parameter server (the driver hosts one per stage), or None: the plan's PS address.
    ps: Optional[tuple[str, int]] = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def describe(self) -> str:
        return f"stage {self.stage} of {self.stages} (replica {self.replica})"


@dataclass(frozen=True)
class Deadlines:
    """The waits a worker makes, each with the key that sets it (``timeouts.*``, else ``ps.timeout_s``)."""

    step: Timeout = field(default_factory=lambda: Timeout.of(120.0, STEP_KEY))
    connect: Timeout = field(default_factory=lambda: Timeout.of(120.0, CONNECT_KEY))
    link: Timeout = field(default_factory=lambda: Timeout.of(120.0, LINK_KEY))

    @classmethod
    def all(cls, seconds: float) -> "Deadlines":
        """Every wait ``seconds`` long, as when only ``ps.timeout_s`` is set."""
        return cls(Timeout.of(seconds, STEP_KEY), Timeout.of(seconds, CONNECT_KEY), Timeout.of(seconds, LINK_KEY))


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    world_size: int
    generation: int
    train_files: tuple[str, ...]
    # The validation split's files (empty: this rank evaluates none of it; see validation_rows).
    validation_files: tuple[str, ...]
    model: ModelSpec
    features_field: str
    label_field: str
    epochs: int
    steps_per_epoch: int
    seed: int
    loader: LoaderPlan = field(default_factory=LoaderPlan)
    faults: FaultPlan = field(default_factory=FaultPlan)
    # The local optimizer of ps.mode=average and of the allreduce backend (the other modes step on the server).
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    backend: str = "ps"  # train.backend: ps | allreduce
    stage: Optional[StagePlan] = None  # set only with parallelism.pipeline > 1
    deadlines: Deadlines = field(default_factory=Deadlines)
    precision: str = "fp32"  # train.precision: fp32 | bf16 | fp16
    profile: bool = False  # train.profile: the per-step timing breakdown (pipeline.worker.timing)
    overlap: bool = False  # ps.overlap: gradient buckets pushed while backward runs (pipeline.worker.buckets)
    # train.allreduce_shared_memory: DDP buckets averaged through /dev/shm when all ranks share a host
    allreduce_shared_memory: bool = True
    # Global step = step_offset + epoch * steps_per_epoch + batch (non-zero after a resume on another world
    # size: pipeline.data.assignment.StreamPlan).
    step_offset: int = 0
    # The rows [start, stop) of validation_files this rank evaluates at the end of each epoch (every rank a
    # part: pipeline.worker.validation; None: all of them).
    validation_rows: Optional[tuple[int, int]] = None
    # data.validation_cache_mb: the part is kept between epochs only within this size, else read again
    validation_cache_mb: float = 256.0

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch) of global step ``step``."""
        return divmod(step - self.step_offset, self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return self.step_offset + self.steps_per_epoch * self.epochs

    @property
    def task(self) -> str:
        return self.model.task

    @property
    def num_features(self) -> int:
        return self.model.num_features
