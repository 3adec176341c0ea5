"""Operations on a batch's inputs dict (see pipeline.config.feature_spec): its row count, moving it to a
device, cutting it into row blocks. A plain tensor (a pipeline stage's activations) works too."""
from __future__ import annotations

from typing import Mapping, Sequence


def batch_rows(inputs) -> int:
    if isinstance(inputs, Mapping):
        return len(next(iter(inputs.values()))) if inputs else 0
    return len(inputs)


def to_device(inputs, device, non_blocking: bool = True):
    if isinstance(inputs, Mapping):
        return {key: value.to(device, non_blocking=non_blocking) for key, value in inputs.items()}
    return inputs.to(device, non_blocking=non_blocking)


def split_batch(inputs, sizes: Sequence[int]) -> list:
    """Consecutive row blocks of `sizes` rows (like torch.split), each a dict like `inputs`."""
    import torch

    if not isinstance(inputs, Mapping):
        return list(torch.split(inputs, list(sizes)))
    pieces = {key: torch.split(value, list(sizes)) for key, value in inputs.items()}
    return [{key: pieces[key][i] for key in inputs} for i in range(len(sizes))]
