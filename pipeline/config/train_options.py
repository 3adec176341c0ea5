"""The ``train.*`` training-essentials sections: learning-rate schedule, early stopping, divergence guard,
and the checks of their combinations with the rest of the config.

The two plain keys next to them in ``schema.TrainConfig``:
``train.clip_grad_norm`` (null: off): clip the gradient that is applied by its global L2 norm — on the
server, the averaged gradient of a sync/ssp step or each async push (needs ps.shards=1); with allreduce,
after DDP's average; in average mode, each local step. Not with parallelism.pipeline > 1.
``train.precision``: fp32, bf16 (autocast of the forward, CPU and GPU) or fp16 (autocast + GradScaler,
CUDA only: refused on a CPU worker). Not with parallelism.pipeline > 1.

Why a module of their own: the schema module is shared by every part of the config; these sections and
their cross-checks change together, so they live here and ``schema.TrainConfig`` only names them.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from pipeline.config.section import Section


class ScheduleConfig(Section):
    """``train.schedule``: linear warmup, then a decay, as a function of the applied step (the server's
    version in ps modes; each replica's local step with average/allreduce), so every copy agrees."""

    # Steps of linear warmup from warmup_start_factor * lr to lr (0: none).
    warmup_steps: int = Field(0, ge=0)
    warmup_start_factor: float = Field(0.01, gt=0, le=1)  # the warm-up starts at lr x this factor
    # After the warmup: none (constant lr), cosine (to min_lr_factor * lr at the last step), step
    # (times gamma every step_size steps), linear (to min_lr_factor * lr at the last step).
    decay: Literal["none", "cosine", "step", "linear"] = "none"
    min_lr_factor: float = Field(0.0, ge=0, le=1)  # cosine decays to lr x this factor
    step_size: int = Field(100, ge=1)  # step schedule: epochs between decays
    gamma: float = Field(0.1, gt=0, le=1)  # step schedule: the factor of each decay


class EarlyStoppingConfig(Section):
    """``train.early_stopping``: stop when the validation metric has not improved for ``patience`` epochs,
    and train with the best epoch's parameters (the run's tags say which epoch)."""

    enabled: bool = False  # stop when the metric has not improved for patience epochs; the best epoch's model is kept
    # An epoch metric: val_loss, val_accuracy (or train_loss when there is no validation split).
    metric: str = Field("val_loss", min_length=1)
    # min for losses, max for accuracies; null: max when the metric name holds "accuracy", else min.
    direction: Optional[Literal["min", "max"]] = None
    patience: int = Field(3, ge=1)  # epochs without improvement before stopping
    # An improvement must beat the best by more than this.
    min_delta: float = Field(0.0, ge=0)


class DivergenceConfig(Section):
    """``train.divergence``: a non-finite training loss, or an epoch's train loss over ``factor`` x the best
    epoch's (and over the first epoch's), stops training and keeps the best epoch's parameters."""

    # null: on where it is supported (train.backend=ps with ps.placement=driver or hosts), off elsewhere.
    enabled: Optional[bool] = None
    # an epoch whose train loss exceeds factor x the best epoch's (and the first's) counts as diverged
    factor: float = Field(10.0, gt=1)
    # warn: the run ends with the best epoch's model, a warning and the tag shardline.diverged;
    # fail: the run fails (DivergedError) so nothing downstream promotes it.
    on_divergence: Literal["warn", "fail"] = "warn"


def check_combinations(cfg) -> None:
    """Combinations of a ``schema.PipelineConfig`` (not imported: schema imports this module) the essentials do not support, refused with the keys to change (ValueError: pydantic
    names it as a config error)."""
    train, p = cfg.train, cfg.parallelism
    if train.clip_grad_norm is not None:
        if p.pipeline > 1:
            raise ValueError("train.clip_grad_norm needs parallelism.pipeline=1: the global norm spans every "
                             "stage's server and is not computed across them; unset train.clip_grad_norm")
        if train.backend == "ps" and cfg.ps.shards > 1 and cfg.ps.mode != "average":
            raise ValueError("train.clip_grad_norm with train.backend=ps needs ps.shards=1: each shard steps its "
                             "own slice, so the global norm would need a round between shards; set ps.shards=1")
        if train.backend == "ps" and cfg.ps.placement == "hosts" and cfg.ps.mode != "average":
            raise ValueError("train.clip_grad_norm with ps.placement=hosts: each host's shard steps its own slice, "
                             "so the global norm would need a round between hosts; set ps.placement=driver")
    if cfg.ps.placement == "hosts" and train.backend == "allreduce":
        raise ValueError("ps.placement=hosts spreads the parameter server's shards over the hosts; "
                         f"train.backend={train.backend} has no server state to spread: set ps.placement=driver")
    if train.precision != "fp32" and p.pipeline > 1:
        raise ValueError(f"train.precision={train.precision} needs parallelism.pipeline=1 (stages exchange fp32 "
                         "activations); use train.precision=fp32")
    watching = train.early_stopping.enabled or train.divergence.enabled is True
    if watching and (train.backend == "allreduce" or cfg.ps.placement == "task"):
        raise ValueError("train.early_stopping / train.divergence need train.backend=ps and ps.placement=driver "
                         "or hosts (the best epoch is kept by the driver); set "
                         "train.early_stopping.enabled=false and train.divergence.enabled=false")


def divergence_on(cfg) -> bool:
    """Whether the divergence guard watches this run: ``train.divergence.enabled``, or, when it is null,
    wherever the guard is supported (the best epoch is kept beside the driver's parameter server)."""
    enabled = cfg.train.divergence.enabled
    if enabled is not None:
        return enabled
    return cfg.train.backend == "ps" and cfg.ps.placement != "task"
