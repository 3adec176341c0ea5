"""Cutting a model into pipeline stages, and where each stage's parameters sit in the flat vector.

A stage is a contiguous run of an ``nn.Sequential``'s children. Because ``Sequential.parameters()``
yields parameters layer by layer, concatenating the stages' flat parameters in stage order gives exactly
``flat_parameters(model)``: each stage owns one contiguous slice of the vector the parameter server
stores, so the PS layout does not change when a model is pipelined.

A leading parameter-less input adapter (a child with ``shardline_input = True``, pipeline.models.inputs)
is not a layer here: layer index 0 is the child after it, so ``parallelism.cuts`` name the same layers
as for a model that takes a tensor, and the adapter always runs in stage 0. An adapter with parameters
(embeddings) is an ordinary layer.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence, Union

import torch.nn as nn

from pipeline.errors import ConfigError
from pipeline.models.flat import num_parameters

logger = logging.getLogger(__name__)

CUTS_KEY = "parallelism.cuts"
STAGES_KEY = "parallelism.pipeline"

Layers = Union[nn.Sequential, Sequence[nn.Module]]


def _layers(model_or_layers: Layers) -> list[nn.Module]:
    if isinstance(model_or_layers, nn.Sequential):
        return list(model_or_layers.children())
    if isinstance(model_or_layers, (list, tuple)) and all(isinstance(m, nn.Module) for m in model_or_layers):
        return list(model_or_layers)
    raise ConfigError(
        f"{STAGES_KEY}: pipeline parallelism cuts an nn.Sequential into stages, got "
        f"{type(model_or_layers).__name__}; use a built-in model, make model.factory return an "
        "nn.Sequential (or a list of stage modules), or set parallelism.pipeline: 1"
    )


def _adapter_count(layers: Sequence[nn.Module]) -> int:
    """1 when the first layer is a parameter-less input adapter (kept out of the layer count), else 0."""
    if layers and getattr(layers[0], "shardline_input", False) and not num_parameters(layers[0]):
        return 1
    return 0


def _check_stages(stages: int, parameterised: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"{STAGES_KEY} must be an integer >= 1, got {stages!r}")
    if stages > parameterised:
        raise ConfigError(
            f"{STAGES_KEY} is {stages} but the model has only {parameterised} layer(s) with parameters; "
            f"every stage needs at least one, so set {STAGES_KEY} <= {parameterised}"
        )


def _balanced(units: list[tuple[int, int]], stages: int) -> list[int]:
    """Contiguous partition of ``units`` (start layer, parameter count) into ``stages`` groups that
    minimises the largest group's parameter count; returns the start layers of groups 1..stages-1."""
    n = len(units)
    prefix = [0]
    for _, count in units:
        prefix.append(prefix[-1] + count)
    inf = float("inf")
    # best[k][i]: smallest possible maximum when the first i units form k groups; cut[k][i]: where the
    # k-th group starts in that optimum. Models have tens of layers, so O(stages * n^2) is nothing.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts = []
    i = n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    starts.reverse()  # starts[0] is unit 0, the first stage
    return [units[u][0] for u in starts[1:]]


def _validate_cuts(cuts: Sequence[int], stages: int, layers: list[nn.Module]) -> list[int]:
    n = len(layers)
    if len(cuts) != stages - 1:
        raise ConfigError(
            f"{CUTS_KEY} has {len(cuts)} entr{'y' if len(cuts) == 1 else 'ies'} but {STAGES_KEY} is "
            f"{stages}: list the first layer index of stages 1..{stages - 1} ({stages - 1} value(s)), or "
            f"leave {CUTS_KEY} unset to balance by parameter count"
        )
    out = []
    for c in cuts:
        if isinstance(c, bool) or not isinstance(c, int):
            raise ConfigError(f"{CUTS_KEY} must be a list of integer layer indices, got {c!r}")
        out.append(c)
    for prev, c in zip([0] + out, out):
        if not 0 < c < n:
            raise ConfigError(
                f"{CUTS_KEY}: cut {c} is out of range; the model has {n} layers, so every cut must be in "
                f"1..{n - 1}"
            )
        if c <= prev:
            raise ConfigError(
                f"{CUTS_KEY} must be strictly increasing (every stage needs at least one layer), got {out}"
            )
    bounds = [0] + out + [n]
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if not any(num_parameters(layer) for layer in layers[a:b]):
            raise ConfigError(
                f"{CUTS_KEY}: stage {s} (layers {a}..{b - 1}) has no parameters; move the cut so every "
                "stage holds a layer with parameters"
            )
    return out


def cut_points(model_or_layers: Layers, stages: int, cuts: Optional[Sequence[int]] = None) -> list[int]:
    """The first layer index of stages 1..stages-1 of an ``nn.Sequential`` (or a list of its layers).

    With ``cuts`` given they are validated and returned. Otherwise the cut balances parameter counts:
    it minimises the largest stage's count, and parameterless layers (activations, dropout) stay with
    the layer before them, so a stage never starts with a ReLU. Errors are ConfigError naming
    ``parallelism.cuts`` / ``parallelism.pipeline``. Indices do not count a leading parameter-less
    input adapter (see the module docstring).
    """
    layers = _layers(model_or_layers)
    layers = layers[_adapter_count(layers):]
    counts = [num_parameters(layer) for layer in layers]
    _check_stages(stages, sum(1 for c in counts if c))
    if cuts is not None:
        return _validate_cuts(cuts, stages, layers)
    units: list[tuple[int, int]] = []
    for index, count in enumerate(counts):
        if units and not (count and units[-1][1]):
            # Parameterless layers join the unit before them; layers before the first parameterised
            # one form a unit that the first parameterised layer joins.
            units[-1] = (units[-1][0], units[-1][1] + count)
        else:
            units.append((index, count))
    return _balanced(units, stages)


def split_stages(model: Union[nn.Module, Sequence[nn.Module]], stages: int,
                 cuts: Optional[Sequence[int]] = None) -> list[nn.Module]:
    """The stage modules of ``model``, in pipeline order, sharing the model's parameter tensors.

    ``model`` is an ``nn.Sequential`` (cut by :func:`cut_points`; each stage is an ``nn.Sequential``
    keeping the original child names) or a list/tuple of stage modules from a user factory, returned
    as they are (then ``stages`` must equal its length and ``cuts`` must be unset). Either way a leading
    parameter-less input adapter runs first in stage 0.
    """
    if isinstance(model, (list, tuple)) and _adapter_count(model):
        stages_list = split_stages(list(model[1:]), stages, cuts)
        return [nn.Sequential(OrderedDict([("input", model[0]), ("0", stages_list[0])]))] + stages_list[1:]
    if isinstance(model, (list, tuple)):
        _check_stages(stages, len(model))
        if len(model) != stages:
            raise ConfigError(
                f"{STAGES_KEY} is {stages} but the model factory returned {len(model)} stage modules; "
                f"set {STAGES_KEY}: {len(model)}"
            )
        if cuts is not None:
            raise ConfigError(f"{CUTS_KEY} cannot be used when the model factory returns stage modules; "
                              f"remove {CUTS_KEY}")
        for index, stage in enumerate(model):
            if not isinstance(stage, nn.Module):
                raise ConfigError(f"stage {index} returned by the model factory is "
                                  f"{type(stage).__name__}, not a torch.nn.Module")
        return list(model)
    starts = cut_points(model, stages, cuts)
    named = list(model.named_children())
    offset = _adapter_count([m for _, m in named])
    bounds = [0] + [start + offset for start in starts] + [len(named)]
    out = [nn.Sequential(OrderedDict(named[a:b])) for a, b in zip(bounds, bounds[1:])]
    logger.debug("cut %s layers into %s stages at %s (parameters per stage: %s)",
                 len(named) - offset, stages, starts, [num_parameters(s) for s in out])
    return out


def stage_slices(stage_modules: Sequence[nn.Module]) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)`` range in the whole model's flat parameter vector."""
    out = []
    start = 0
    for stage in stage_modules:
        end = start + num_parameters(stage)
        out.append((start, end))
        start = end
    return out


def model_stages(model, stages: int, cuts=None) -> list:
    """The stage modules of the whole model (a factory's own stages when it returned a list of them)."""
    if getattr(model, "shardline_stages", False):
        return split_stages(list(model.children()), stages, cuts)
    return split_stages(model, stages, cuts)
