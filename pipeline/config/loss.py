"""The loss keys of ``model.*`` (``model.loss`` and what it takes), a mixin of ``ModelConfig``; what each
loss computes is ``pipeline.models.losses``."""
from __future__ import annotations

import re
import typing
from typing import Any, Optional

from pydantic import BaseModel, Field, field_validator

FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class LossFields(BaseModel):
    # Training loss (pipeline/models/losses.py): auto (cross_entropy for classification, mse for regression),
    # cross_entropy, bce (two classes: one logit, torch's BCE with logits), mse, huber, or
    # "package.module:function" called as function(task=, num_classes=, **loss_kwargs) -> loss(output, target).
    loss: str = "auto"
    # keyword arguments for model.loss (e.g. huber's delta, a factory's own settings)
    loss_kwargs: dict[str, Any] = Field(default_factory=dict)
    # cross_entropy/bce: label smoothing epsilon, as torch's CrossEntropyLoss(label_smoothing=).
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    # cross_entropy/bce: one weight per class in class order, or {label value: weight} (others 1), as torch's
    # CrossEntropyLoss(weight=) (a weighted mean) and BCEWithLogitsLoss(weight=w[y]) (a plain mean).
    class_weights: Optional[typing.Union[list[float], dict[str, float]]] = None
    # huber: the delta, on the standardized target's scale (standardize_target) or the raw one.
    huber_delta: float = Field(1.0, gt=0)
    # Regression: train on (y - mean) / std of the train split's targets; the model maps its predictions back
    # to the label's scale (evaluation, scoring, the MLflow and Spark ML models see raw-scale predictions).
    standardize_target: bool = True

    @field_validator("loss")
    @classmethod
    def _loss_known(cls, value: str) -> str:
        if value not in ("auto", "cross_entropy", "bce", "mse", "huber") and not FACTORY.match(value):
            raise ValueError(f"must be auto, cross_entropy, bce, mse, huber or 'package.module:function', got {value!r}")
        return value

    @field_validator("class_weights", mode="before")
    @classmethod
    def _weights_by_text(cls, value: Any) -> Any:
        # YAML reads `{0: 2.0}` with integer keys; the keys are label values written as text.
        if isinstance(value, dict):
            return {str(k): v for k, v in value.items()}
        return value

    @field_validator("class_weights")
    @classmethod
    def _weights_positive(cls, value: Any) -> Any:
        weights = list(value.values()) if isinstance(value, dict) else value
        if weights is not None and (not weights or any(not w > 0 for w in weights)):
            raise ValueError(f"class weights must be a non-empty list or map of numbers > 0, got {value}")
        return value

