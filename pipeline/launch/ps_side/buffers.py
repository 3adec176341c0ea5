"""Beside the PS (driver or rank 0's task): the server's store of a model's buffers, with the model's own
merge rule (the server knows no model: ``pipeline.ps.state.buffers``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of module import time
    import torch


def buffer_store(module, initial: "torch.Tensor"):
    """A PS buffer store for ``module``'s buffers, merged by ``pipeline.models.state.merge_buffers``."""
    from functools import partial

    from pipeline.models.state import buffer_layout, merge_buffers
    from pipeline.ps.state.buffers import BufferStore

    return BufferStore(initial, partial(merge_buffers, buffer_layout(module)))

