"""``tune``: the hyperparameter search of ``shardline tune`` (Optuna), validated at construction.

    tune:
      trials: 8
      metric: val_accuracy            # an epoch-row key; maximized when it is an accuracy, else minimized
      space:
        train.lr: {low: 0.001, high: 0.3, log: true}
        train.batch_size: {choices: [32, 64, 128]}
        model.hidden: {choices: [[64], [128, 64]]}
        train.epochs: {low: 2, high: 6, step: 1}   # ints when low, high (and step) are all ints

Every trial trains on the same shard set (one ETL for the study), so the space may only hold keys that
do not change the data: ``model.*``, ``train.*``, ``ps.*`` and ``parallelism.*``. That each key exists
and each value is valid is checked by building a trial's config (``pipeline.tune``), before any trial runs.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from pipeline.config.section import SEED, Section

SEARCHABLE_SECTIONS = ("model", "train", "ps", "parallelism")


class SearchRange(Section):
    """A number from [low, high]: a float, or an int when low, high and step are all ints."""

    low: Union[int, float]
    high: Union[int, float]
    log: bool = False
    step: Optional[Union[int, float]] = Field(None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "SearchRange":
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0 (got {self.low})")
        if self.log and self.step is not None:
            raise ValueError("log: true and step cannot be combined (Optuna samples one or the other)")
        return self

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) for v in (self.low, self.high)) and (self.step is None or
                                                                            isinstance(self.step, int))


class SearchChoices(Section):
    """One of the listed values (any YAML value: numbers, strings, lists such as model.hidden)."""

    choices: list[Any] = Field(min_length=1)


class TuneConfig(Section):
    trials: int = Field(8, ge=1)  # trials in the study (shardline tune --trials overrides it)
    # the epoch-row key Optuna optimizes and the pruner watches (val_accuracy, val_loss, train_loss, ...)
    metric: str = Field("val_accuracy", min_length=1)
    # null: maximize when the metric is an accuracy/f1/auc/r2, else minimize (losses).
    direction: Optional[Literal["maximize", "minimize"]] = None
    # key -> {low, high, log, step} or {choices: [...]}: what the search varies
    space: dict[str, Union[SearchChoices, SearchRange]] = Field(default_factory=dict)
    # median: stop a trial whose epoch-k metric is worse than the median of earlier trials at epoch k.
    pruner: Literal["median", "none"] = "median"
    startup_trials: int = Field(2, ge=0)  # trials that always run to the end before pruning starts
    study: Optional[str] = Field(None, min_length=1)  # null: "<name>-tune"
    storage: Optional[str] = Field(None, min_length=1)  # null: sqlite:///<workdir>/optuna.db
    seed: Optional[int] = Field(None, **SEED)  # the sampler's; null: train.seed

    @field_validator("space")
    @classmethod
    def _searchable(cls, space: dict) -> dict:
        for key in space:
            section = key.split(".", 1)[0]
            if section not in SEARCHABLE_SECTIONS or "." not in key:
                raise ValueError(f"tune.space key {key!r}: only {', '.join(s + '.*' for s in SEARCHABLE_SECTIONS)} "
                                 "can be searched (every trial trains on the study's one shard set; search data.* "
                                 "settings with one study per shard set)")
        return space

    @property
    def maximize(self) -> bool:
        if self.direction is not None:
            return self.direction == "maximize"
        return any(word in self.metric for word in ("accuracy", "f1", "auc", "r2", "precision", "recall"))
