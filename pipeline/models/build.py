"""Model construction from a plain, picklable spec, so executors rebuild exactly the driver's model."""
from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from pipeline.config.feature_spec import FeatureSet
from pipeline.config.schema import ModelConfig
from pipeline.models.losses import network_outputs, with_head

_ACTIVATIONS = {"relu": "ReLU", "tanh": "Tanh", "gelu": "GELU"}


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the model anywhere: plain values only (crosses into Spark tasks)."""

    kind: str
    num_features: int
    num_outputs: int
    task: str
    hidden: tuple[int, ...] = ()
    activation: str = "relu"
    dropout: float = 0.0
    factory: Optional[str] = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)
    # FeatureSpec.to_dict() of each feature; empty for a classic spec (num_features packed numeric columns).
    features: tuple[dict[str, Any], ...] = ()
    # pipeline.models.losses.LossSpec.to_dict() (empty: the task's default loss).
    loss: dict[str, Any] = field(default_factory=dict)
    # Regression: (mean, std) of the train split's targets; the network learns the standardized target and
    # its output head maps back (pipeline.models.losses). None: trained on the raw target.
    target_scale: Optional[tuple[float, float]] = None
    batch_norm: bool = False  # built-ins: a BatchNorm1d after each hidden linear layer
    # ps.sparse.model_options(): which tabular embeddings are sparse tables on the PS (min_rows, init_std, seed,
    # wire_dtype) and, once trained, "tables": the directory of their rows (pipeline.models.sparse_embedding).
    sparse: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.features and self.feature_set.numeric_width != self.num_features:
            raise ValueError(f"num_features is {self.num_features} but the features' numeric block is "
                             f"{self.feature_set.numeric_width} wide")

    @property
    def feature_set(self) -> FeatureSet:
        if self.features:
            return FeatureSet.from_list(self.features)
        return FeatureSet.numeric_only([f"x{i}" for i in range(self.num_features)], standardize=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["batch_norm"]:  # absent unless set: specs (and checkpoints) from before it stay equal
            del data["batch_norm"]
        if not data["sparse"]:
            del data["sparse"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        data = dict(data)
        data["hidden"] = tuple(data.get("hidden", ()))
        data["features"] = tuple(dict(f) for f in data.get("features", ()))  # absent in specs before typed features
        if data.get("loss"):
            from pipeline.models.losses import LossSpec

            data["loss"] = LossSpec.from_dict(data["loss"]).to_dict()
        if data.get("target_scale") is not None:
            data["target_scale"] = tuple(float(v) for v in data["target_scale"])
        return cls(**data)


def model_spec(config: ModelConfig, *, num_features: Optional[int] = None, features: Optional[FeatureSet] = None,
               num_classes: Optional[int], task: str, labels: Optional[tuple[str, ...]] = None,
               target_scale: Optional[tuple[float, float]] = None,
               sparse: Optional[dict[str, Any]] = None) -> ModelSpec:
    """The spec of ``config``'s model for ``features`` (or, classic, ``num_features`` packed numeric columns).
    ``labels``: the class label values (for model.class_weights by label); ``target_scale``: regression's
    train-split (mean, std), used when model.standardize_target is on."""
    from pipeline.models.losses import loss_spec
    if features is not None:
        if num_features is not None and num_features != features.numeric_width:
            raise ValueError(f"num_features={num_features} disagrees with the features' numeric width "
                             f"{features.numeric_width}; pass features alone")
        num_features = features.numeric_width
    elif num_features is None:
        raise TypeError("model_spec needs features (a FeatureSet) or num_features")
    num_outputs = num_classes if task == "classification" else 1
    if task == "classification" and (num_classes is None or num_classes < 2):
        from pipeline.errors import DataError

        raise DataError(f"classification needs at least 2 label classes, found {num_classes}")
    return ModelSpec(
        kind="factory" if config.factory else config.kind,
        num_features=num_features,
        num_outputs=num_outputs,
        task=task,
        hidden=tuple(config.hidden),
        activation=config.activation,
        dropout=config.dropout,
        batch_norm=config.batch_norm,
        factory=config.factory,
        factory_kwargs=dict(config.factory_kwargs),
        features=tuple(features.to_list()) if features is not None else (),
        loss=loss_spec(config, task, _labels(labels, num_classes) if task == "classification" else None).to_dict(),
        target_scale=(tuple(float(v) for v in target_scale)
                      if target_scale is not None and task == "regression" and config.standardize_target else None),
        sparse=dict(sparse or {}),
    )


def _labels(labels: Optional[tuple[str, ...]], num_classes: Optional[int]) -> tuple[str, ...]:
    return tuple(labels) if labels is not None else tuple(str(i) for i in range(num_classes or 0))


def _resolve_factory(path: str) -> Callable[..., Any]:
    from pipeline.models.resolve import resolve_callable

    return resolve_callable(path, "model.factory")


def _is_classic(factory: Callable[..., Any]) -> bool:
    """A factory taking ``num_features`` (and no ``features``) maps one float tensor: the form before
    typed features. One whose signature cannot be read is taken as the current form."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "num_features" in params and "features" not in params


def _with_input(model, adapter):
    """``adapter`` then ``model``, flattened into one nn.Sequential when ``model`` is a plain Sequential
    or a list of stage modules, so pipeline cuts still see its layers (or its stages)."""
    import torch.nn as nn

    if isinstance(model, (list, tuple)):
        # A factory may return its pipeline stages; the whole model is their composition, and each
        # stage stays one child, so parallelism.pipeline cuts it exactly there.
        wrapped = nn.Sequential(OrderedDict([("input", adapter)] + [(str(i), m) for i, m in enumerate(model)]))
        wrapped.shardline_stages = True
        return wrapped
    children = list(model.named_children())
    if type(model).forward is nn.Sequential.forward and all(name != "input" for name, _ in children):
        # Keep the user's child names, so the model's state_dict keys are what the factory built.
        wrapped = nn.Sequential(OrderedDict([("input", adapter), *children]))
        if getattr(model, "shardline_stages", False):
            wrapped.shardline_stages = True
        return wrapped
    return nn.Sequential(OrderedDict([("input", adapter), ("model", model)]))


def _build_factory(spec: ModelSpec):
    import torch.nn as nn

    from pipeline.errors import ConfigError
    from pipeline.models.inputs import NumericInput

    factory = _resolve_factory(spec.factory)
    features = spec.feature_set
    classic = _is_classic(factory)
    if classic:
        if not features.only_numeric:
            others = [f"{f.name} ({f.type})" for f in features if f.type != "numeric"]
            raise ConfigError(
                f"model.factory {spec.factory!r} takes num_features (the classic form: one float tensor of the "
                f"numeric features) but data.features also has {', '.join(others)}; give the factory a "
                "`features` parameter to receive the FeatureSet, and take the batch dict in forward"
            )
        model = factory(num_features=spec.num_features, num_outputs=network_outputs(spec), **spec.factory_kwargs)
    else:
        model = factory(features=features, num_outputs=network_outputs(spec), **spec.factory_kwargs)
    stages = isinstance(model, (list, tuple)) and bool(model) and all(isinstance(m, nn.Module) for m in model)
    if not (stages or isinstance(model, nn.Module)):
        raise ConfigError(f"model.factory {spec.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    if classic:
        return _with_input(model, NumericInput())
    if stages:
        model = nn.Sequential(*model)
        model.shardline_stages = True
    return model


def head_layers(width: int, spec: ModelSpec) -> list:
    """The MLP head every built-in ends in: model.hidden layers (with model.batch_norm, each followed by a
    BatchNorm1d) of model.activation (and model.dropout), then a linear layer to the outputs."""
    import torch.nn as nn

    layers: list[nn.Module] = []
    for hidden in spec.hidden:
        layers.append(nn.Linear(width, hidden))
        if spec.batch_norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(getattr(nn, _ACTIVATIONS[spec.activation])())
        if spec.dropout:
            layers.append(nn.Dropout(spec.dropout))
        width = hidden
    layers.append(nn.Linear(width, network_outputs(spec)))
    return layers


def build_model(spec: ModelSpec):
    """A fresh torch module for `spec`, whose forward takes the batch dict. Built-ins are an
    nn.Sequential whose first child (named ``input``) is an input adapter from pipeline.models.inputs,
    then layers named 0, 1, ...; plain torch modules, so the exported model loads without our code."""
    import torch.nn as nn

    from pipeline.errors import ConfigError

    if spec.kind == "factory":
        return with_head(_build_factory(spec), spec)
    if spec.kind == "cnn":
        from pipeline.models.cnn import build_cnn

        return with_head(build_cnn(spec.feature_set, lambda width: head_layers(width, spec)), spec)
    if spec.kind not in ("mlp", "tabular", "logreg"):
        raise ConfigError(f"model.kind {spec.kind!r} is not one of mlp, tabular, logreg, cnn")
    from pipeline.models.inputs import TabularInput

    adapter = TabularInput(spec.feature_set, spec.sparse)
    if spec.kind == "logreg":
        layers = [nn.Linear(adapter.out_features, network_outputs(spec))]
    else:
        layers = head_layers(adapter.out_features, spec)
    model = nn.Sequential(OrderedDict([("input", adapter)] + [(str(i), m) for i, m in enumerate(layers)]))
    if spec.sparse.get("tables"):  # a trained model: its sparse tables' rows, served from this process
        from pipeline.models.sparse_embedding import load_tables

        load_tables(model, spec.sparse["tables"])
    return with_head(model, spec)


def model_from_flat(spec: dict, parameters):
    """An eval-mode module for a spec dict holding flat fp32 `parameters` (bytes, an array, or a Spark
    broadcast of either): how scoring UDFs rebuild the trained model on executors."""
    import numpy as np
    import torch

    from pipeline.models.state import load_flat_state

    value = parameters.value if hasattr(parameters, "value") else parameters
    flat = (np.frombuffer(value, dtype=np.float32) if isinstance(value, (bytes, bytearray, memoryview))
            else np.asarray(value, dtype=np.float32))
    model = build_model(ModelSpec.from_dict(spec))
    load_flat_state(model, torch.from_numpy(flat.copy()))
    model.eval()
    return model


def loss_fn(spec: "ModelSpec | str"):
    """Mean loss over a batch of a ModelSpec (its model.loss, pipeline.models.losses); classification takes
    int64 class indices, regression float targets. A bare task name gives that task's default loss."""
    from pipeline.models.losses import make_loss

    if isinstance(spec, str):
        spec = ModelSpec(kind="mlp", num_features=1, num_outputs=1 if spec == "regression" else 2, task=spec)
    return make_loss(spec)
