"""Buffers are model state: the flat *state* of a model is its flat fp32 parameters followed by its
registered buffers (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked`` and any other
persistent buffer), the unit the merged model, checkpoints, evaluation, scoring and the served model carry.

Why one flat fp32 vector and not a second typed blob: every consumer of the merged model (the Spark
evaluation broadcast, ``shardline score``, the Spark ML model's persistence, the MLflow model, the saved
``model.pt``) already moves one flat fp32 vector; appending the buffers to it makes all of them carry
buffers with no new format. The buffer tail is a container of 4-byte words, each buffer encoded exactly:

* float32 buffers: their values;
* 8-byte dtypes (int64 ``num_batches_tracked``, float64): their raw little-endian bytes, 2 words per
  element (a bit-for-bit reinterpretation, never a float conversion, so counters stay exact);
* other 4-byte dtypes (int32): their raw bytes, 1 word per element;
* 1- and 2-byte dtypes (bool, uint8, int8, int16, float16, bfloat16): their value as float32 (exact).

So the words of an integer buffer are *not numbers*: nothing may average or NaN-check the tail as floats.
The parameter server merges replicas' buffers buffer by buffer in their own dtype (``merge_buffers``).

Only persistent buffers (those in ``state_dict()``) are state; ``register_buffer(..., persistent=False)``
caches are rebuilt by the module itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from pipeline.models.flat import flat_parameters, load_flat_parameters, num_parameters

if TYPE_CHECKING:  # torch stays out of module import time
    import torch

# One entry per buffer, in ``state_buffers`` order: (torch dtype name without "torch.", element count).
BufferLayout = tuple[tuple[str, int], ...]


def state_buffers(model) -> list:
    """The model's persistent buffers in ``named_buffers()`` order (shared buffers once)."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    return [b for name, b in model.named_buffers() if name in persistent]


def buffer_layout(model) -> BufferLayout:
    return tuple((str(b.dtype).removeprefix("torch."), b.numel()) for b in state_buffers(model))


def _dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown buffer dtype {name!r}")
    return dtype


def _words_per_element(dtype) -> int:
    return 2 if dtype.itemsize == 8 else 1


def _bitcast(dtype) -> bool:
    """Whether a dtype travels as its raw bytes (4- and 8-byte types) rather than as a float32 value."""
    import torch

    return dtype.itemsize in (4, 8) and dtype is not torch.float32


def layout_slots(layout: BufferLayout) -> int:
    """fp32 words the buffers of ``layout`` take in the flat state."""
    return sum(numel * _words_per_element(_dtype(name)) for name, numel in layout)


def encode_buffer(tensor) -> torch.Tensor:
    """One buffer as fp32 words (a new CPU tensor; see the module docstring for the encoding)."""
    import torch

    flat = tensor.detach().reshape(-1).to("cpu").contiguous()
    if flat.dtype is torch.float32:
        return flat.clone()
    if _bitcast(flat.dtype):
        return flat.view(torch.uint8).view(torch.float32).clone()
    return flat.to(torch.float32)


def decode_buffer(words, name: str, numel: int) -> torch.Tensor:
    """The inverse of ``encode_buffer``: ``numel`` elements of dtype ``name`` from their fp32 words."""
    import torch

    dtype = _dtype(name)
    words = words.reshape(-1).contiguous()
    if words.numel() != numel * _words_per_element(dtype):
        raise ValueError(f"a {name} buffer of {numel} elements takes {numel * _words_per_element(dtype)} words, "
                         f"got {words.numel()}")
    if dtype is torch.float32:
        return words.clone()
    if _bitcast(dtype):
        return words.view(torch.uint8).view(dtype).clone()
    return words.to(dtype)


def split_buffers(layout: BufferLayout, words) -> list:
    """The buffers of ``layout`` decoded from their concatenated fp32 words."""
    if words.numel() != layout_slots(layout):
        raise ValueError(f"the buffers take {layout_slots(layout)} words, got {words.numel()}")
    out, offset = [], 0
    for name, numel in layout:
        n = numel * _words_per_element(_dtype(name))
        out.append(decode_buffer(words[offset:offset + n], name, numel))
        offset += n
    return out


def flat_buffers(model) -> torch.Tensor:
    """The model's persistent buffers as one fp32 word vector (empty when it has none)."""
    import torch

    parts = [encode_buffer(b) for b in state_buffers(model)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


def load_flat_buffers(model, words) -> None:
    import torch

    buffers = state_buffers(model)
    values = split_buffers(buffer_layout(model), words)
    with torch.no_grad():
        for buffer, value in zip(buffers, values):
            buffer.copy_(value.view_as(buffer))


def merge_buffers(layout: BufferLayout, by_rank: Mapping[int, "torch.Tensor"]) -> torch.Tensor:
    """The merged buffers of the replicas that reported (rank -> fp32 words): floating-point buffers
    averaged elementwise (in float64, then back to their dtype); integer and bool buffers — counters such
    as ``num_batches_tracked`` — taken from the lowest reporting rank (every replica runs the same number
    of steps, so counters agree; averaging them as floats would not even be an integer)."""
    import torch

    if not by_rank:
        raise ValueError("no replica reported buffers")
    ranks = sorted(by_rank)
    per_rank = [split_buffers(layout, by_rank[r]) for r in ranks]
    merged = []
    for i, (name, _numel) in enumerate(layout):
        dtype = _dtype(name)
        if dtype.is_floating_point or dtype.is_complex:
            stacked = torch.stack([values[i].to(torch.complex128 if dtype.is_complex else torch.float64)
                                   for values in per_rank])
            merged.append(encode_buffer(stacked.mean(dim=0).to(dtype)))
        else:
            merged.append(encode_buffer(per_rank[0][i]))
    return torch.cat(merged) if merged else torch.empty(0, dtype=torch.float32)


def state_size(model) -> int:
    """Elements of ``flat_state(model)``: parameters plus buffer words."""
    return num_parameters(model) + layout_slots(buffer_layout(model))


def flat_state(model) -> torch.Tensor:
    """Flat parameters followed by the buffer words: the merged model's one vector."""
    import torch

    return torch.cat([flat_parameters(model), flat_buffers(model)])


def join_state(parameters, buffers) -> torch.Tensor:
    """A flat state from its two parts (``buffers`` may be None or empty: no buffers)."""
    import torch

    if buffers is None or buffers.numel() == 0:
        return parameters
    return torch.cat([parameters.reshape(-1).to(torch.float32), buffers.reshape(-1).to(torch.float32)])


def load_flat_state(model, flat) -> None:
    """Load a flat state into ``model``. A vector of only ``num_parameters`` elements (a model saved
    before buffers were state, or one without buffers) loads the parameters and leaves the buffers as
    they are; any other length than the two is an error."""
    params = num_parameters(model)
    total = state_size(model)
    if flat.numel() == params:
        load_flat_parameters(model, flat)
        return
    if flat.numel() != total:
        raise ValueError(f"flat model state has {flat.numel()} elements, the model has {params} parameters "
                         f"and {total - params} buffer words ({total} in all)")
    flat = flat.reshape(-1)
    load_flat_parameters(model, flat[:params])
    load_flat_buffers(model, flat[params:])


def concat_layouts(layouts: Sequence[BufferLayout]) -> BufferLayout:
    return tuple(entry for layout in layouts for entry in layout)
