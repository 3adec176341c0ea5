"""Row-wise optimizers of sparse tables: SGD, Adagrad and lazy Adam, stepping only the rows a step touched.

Why not ``torch.optim``: its optimizers step whole parameter tensors, and a table's state lives in
growable slot arrays of which a step touches a few thousand rows; ``torch.optim.SparseAdam`` needs a
sparse ``.grad`` of the whole (declared) table and one global step count. These are the same update
rules written over ``index_select``/``index_copy_`` of the touched slots, in the operation order torch
uses, so SGD and Adagrad give exactly what ``torch.optim.SGD``/``Adagrad`` give on a dense
``nn.Embedding`` (untouched rows have a zero gradient there and do not move). Adam is lazy: each row
keeps its own step count (its bias correction), as ``SparseAdam`` does for its moments.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.errors import ConfigError

OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class RowOptimizerSpec:
    """``ps.sparse.optimizer`` and its rates (plain values: crosses to the server's process)."""

    name: str = "adagrad"
    lr: float = 0.05
    eps: float = 1e-10  # adagrad's default; adam uses adam_eps
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"ps.sparse.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if not self.lr > 0:
            raise ConfigError(f"ps.sparse.lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # Per-row state each optimizer keeps: name -> width (0: one value per row, else the table's dim).
    def state_widths(self) -> dict[str, int]:
        return {"sgd": {}, "adagrad": {"sum": 1}, "adam": {"exp_avg": 1, "exp_avg_sq": 1, "steps": 0}}[self.name]


def new_state(spec: RowOptimizerSpec, capacity: int, dim: int) -> dict[str, torch.Tensor]:
    """Zeroed state for ``capacity`` slots."""
    return {name: (torch.zeros(capacity, dim) if width else torch.zeros(capacity, dtype=torch.int64))
            for name, width in spec.state_widths().items()}


def step_rows(spec: RowOptimizerSpec, rows: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor,
              grad: torch.Tensor, lr_scale: float = 1.0) -> None:
    """One update of ``rows[slots]`` with ``grad`` (fp32 [n, dim], one row per distinct slot)."""
    lr = spec.lr * lr_scale
    param = rows.index_select(0, slots)
    if spec.name == "sgd":
        param.add_(grad, alpha=-lr)
    elif spec.name == "adagrad":
        total = state["sum"].index_select(0, slots).addcmul_(grad, grad, value=1.0)
        state["sum"].index_copy_(0, slots, total)
        param.addcdiv_(grad, total.sqrt().add_(spec.eps), value=-lr)
    else:
        beta1, beta2 = spec.betas
        steps = state["steps"].index_select(0, slots) + 1
        state["steps"].index_copy_(0, slots, steps)
        avg = state["exp_avg"].index_select(0, slots).mul_(beta1).add_(grad, alpha=1 - beta1)
        avg_sq = state["exp_avg_sq"].index_select(0, slots).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].index_copy_(0, slots, avg)
        state["exp_avg_sq"].index_copy_(0, slots, avg_sq)
        t = steps.to(torch.float64).unsqueeze(1)
        correction1 = (1 - beta1 ** t).to(torch.float32)
        correction2_sqrt = (1 - beta2 ** t).sqrt().to(torch.float32)
        denom = (avg_sq.sqrt() / correction2_sqrt).add_(spec.adam_eps)
        param.addcdiv_(avg / correction1, denom, value=-lr)
    rows.index_copy_(0, slots, param)
