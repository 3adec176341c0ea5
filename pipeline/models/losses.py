"""Training losses (``model.loss``) and the output heads some of them need, built from plain values.

* ``cross_entropy`` (classification; ``auto`` picks it): ``torch.nn.functional.cross_entropy`` with
  ``model.label_smoothing`` and ``model.class_weights`` exactly as torch applies them (a weighted mean:
  the sum of ``w[y] * loss`` over the sum of ``w[y]``).
* ``bce`` (two classes): the network emits one logit ``z`` for class 1; a fixed head turns it into the
  two logits ``[0, z]``, whose softmax is ``[1 - sigmoid(z), sigmoid(z)]``, so evaluation, scoring and
  the served models read two class logits/probabilities as for any classifier. The loss is torch's
  ``binary_cross_entropy_with_logits(z, y)``; class weights rescale each row by ``w[y]`` (torch's
  ``weight=``: a plain mean), label smoothing moves the targets to ``eps/2`` and ``1 - eps/2``.
* ``mse`` (regression; ``auto`` picks it) and ``huber`` (``model.huber_delta``): torch's ``mse_loss`` /
  ``huber_loss``.
* ``"package.module:function"``: called once per process as ``function(task=..., num_classes=...,
  **model.loss_kwargs)``; it returns ``loss(output, target) -> scalar tensor`` (the mean over the batch).

Regression targets are standardized on the train split (``model.standardize_target``): the network
learns ``(y - mean) / std`` and a fixed head (``TargetScale``, no parameters) maps its output back, so the
model itself predicts on the label's own scale everywhere it runs (evaluation, ``shardline score``, the
MLflow and Spark ML models). Losses compare the standardized output with the standardized target, so
the default lr fits targets in the tens or the thousands alike; ``val_loss`` is on that scale too, the
evaluation's mse/rmse/mae on the label's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

BUILTIN = ("auto", "cross_entropy", "bce", "mse", "huber")
CLASSIFICATION = ("cross_entropy", "bce")
REGRESSION = ("mse", "huber")


@dataclass(frozen=True)
class LossSpec:
    """The loss of a model, plain values only (it travels inside the ModelSpec to every task)."""

    kind: str = "auto"
    label_smoothing: float = 0.0
    class_weights: tuple[float, ...] = ()
    huber_delta: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_factory(self) -> bool:
        return ":" in self.kind

    def resolved(self, task: str) -> str:
        if self.kind == "auto":
            return "cross_entropy" if task == "classification" else "mse"
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples), so a spec equals itself after a round trip through JSON."""
        return {**asdict(self), "class_weights": list(self.class_weights)}

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> "LossSpec":
        data = dict(data or {})
        data["class_weights"] = tuple(data.get("class_weights", ()))
        return cls(**data)


def loss_spec(config, task: str, labels: Optional[tuple[str, ...]]) -> LossSpec:
    """The LossSpec of a ModelConfig for ``task`` with class ``labels``; a mismatch is a ConfigError naming
    the key and the fix."""
    from pipeline.errors import ConfigError

    spec = LossSpec(kind=config.loss, label_smoothing=config.label_smoothing,
                    class_weights=_class_weights(config.class_weights, labels),
                    huber_delta=config.huber_delta, kwargs=dict(config.loss_kwargs))
    kind = spec.resolved(task)
    if spec.is_factory:
        return spec
    if task == "classification" and kind not in CLASSIFICATION:
        raise ConfigError(f"model.loss={kind} is a regression loss but data.task=classification; use "
                          "cross_entropy (or bce for two classes), or set data.task=regression")
    if task == "regression" and kind not in REGRESSION:
        raise ConfigError(f"model.loss={kind} is a classification loss but data.task=regression; use mse or huber")
    if kind == "bce" and labels is not None and len(labels) != 2:
        raise ConfigError(f"model.loss=bce needs exactly two classes, the label has {len(labels)}; use cross_entropy")
    if task == "regression" and (spec.class_weights or spec.label_smoothing):
        raise ConfigError("model.class_weights and model.label_smoothing are for classification; remove them "
                          "for data.task=regression")
    return spec


def _class_weights(weights, labels: Optional[tuple[str, ...]]) -> tuple[float, ...]:
    """model.class_weights as one weight per class index: a list in class order, or {label: weight}
    (labels not named weigh 1)."""
    from pipeline.errors import ConfigError

    if not weights:
        return ()
    if labels is None:
        raise ConfigError("model.class_weights is for classification; remove it for data.task=regression")
    if isinstance(weights, dict):
        unknown = sorted(set(weights) - set(labels))
        if unknown:
            raise ConfigError(f"model.class_weights names {unknown}, which are not label values (the classes are "
                              f"{list(labels)}); key the weights by label value")
        return tuple(float(weights.get(label, 1.0)) for label in labels)
    if len(weights) != len(labels):
        raise ConfigError(f"model.class_weights has {len(weights)} weights but there are {len(labels)} classes "
                          f"({list(labels)}); give one per class in this order, or a {{label: weight}} map")
    return tuple(float(w) for w in weights)


def network_outputs(spec) -> int:
    """How many outputs the network itself emits (bce: one logit, the head adds the other)."""
    return 1 if spec.task == "classification" and LossSpec.from_dict(spec.loss).resolved(spec.task) == "bce" \
        else spec.num_outputs


def output_head(spec):
    """The fixed module a spec's network output goes through, or None (see module docstring)."""
    from pipeline.models.heads import BinaryLogits, TargetScale

    if spec.task == "classification":
        return BinaryLogits() if network_outputs(spec) == 1 else None
    if spec.target_scale:
        mean, std = spec.target_scale
        return TargetScale(mean, std)
    return None


def with_head(model, spec):
    """``model`` followed by its output head: appended as the last child of a plain nn.Sequential (the
    pipeline cuts still see the same layers, the head on the last stage), else wrapped."""
    from collections import OrderedDict

    import torch.nn as nn

    head = output_head(spec)
    if head is None:
        return model
    if type(model).forward is nn.Sequential.forward and "output" not in dict(model.named_children()):
        if getattr(model, "shardline_stages", False):
            # One child per stage: the head joins the last stage, so the stage count stays the factory's.
            children = list(model.named_children())
            name, last = children[-1]
            model._modules[name] = nn.Sequential(OrderedDict([("stage", last), ("output", head)]))
            return model
        model.add_module("output", head)
        return model
    return nn.Sequential(OrderedDict([("model", model), ("output", head)]))


def make_loss(spec) -> Callable:
    """The batch-mean loss ``loss(output, target)`` of a ModelSpec: classification takes int64 class
    indices, regression float targets (on the label's scale; standardized here when the spec is)."""
    import torch
    import torch.nn.functional as F

    loss = LossSpec.from_dict(spec.loss)
    kind = loss.resolved(spec.task)
    scale = spec.target_scale if spec.task == "regression" else None

    def standardized(output, target):
        output = output.reshape(output.shape[0], -1).squeeze(-1)
        if scale:
            mean, std = scale
            return (output - mean) / std, (target - mean) / std
        return output, target

    if loss.is_factory:
        user = _resolve(loss.kind)(task=spec.task, num_classes=spec.num_outputs if spec.task == "classification"
                                   else None, **loss.kwargs)
        if spec.task == "regression":
            return lambda output, target: user(*standardized(output, target.float()))
        return user
    weights = torch.tensor(loss.class_weights, dtype=torch.float32) if loss.class_weights else None
    if kind == "cross_entropy":
        smoothing = loss.label_smoothing

        def cross_entropy(output, target):
            w = None if weights is None else weights.to(output.device)
            return F.cross_entropy(output, target, weight=w, label_smoothing=smoothing)

        return cross_entropy
    if kind == "bce":
        eps = loss.label_smoothing

        def bce(output, target):
            z = output[:, 1] - output[:, 0]  # the head's [0, z]; also right for any two logits
            y = target.to(z.dtype)
            if eps:
                y = y * (1 - eps) + eps / 2
            w = None if weights is None else weights.to(output.device)[target]
            return F.binary_cross_entropy_with_logits(z, y, weight=w)

        return bce
    if kind == "huber":
        delta = loss.huber_delta
        return lambda output, target: F.huber_loss(*standardized(output, target.float()), delta=delta)
    return lambda output, target: F.mse_loss(*standardized(output, target.float()))


def loss_weight(spec) -> Callable:
    """``weight(target) -> float``: the denominator of ``make_loss(spec)``'s batch mean, so that means over
    parts weighted by it equal the mean over their union (``pipeline.worker.validation``). A weighted
    cross entropy divides by the sum of its rows' class weights (torch's weighted mean, label smoothing
    included); every other loss, the bce with class weights and a ``model.loss`` factory's included, by the
    row count."""
    import torch

    loss = LossSpec.from_dict(spec.loss)
    if spec.task == "classification" and not loss.is_factory and loss.class_weights \
            and loss.resolved(spec.task) == "cross_entropy":
        weights = torch.tensor(loss.class_weights, dtype=torch.float64)
        return lambda target: float(weights[target.cpu()].sum())
    return lambda target: float(target.shape[0])


def _resolve(path: str) -> Callable[..., Any]:
    from pipeline.models.resolve import resolve_callable

    return resolve_callable(path, "model.loss")
