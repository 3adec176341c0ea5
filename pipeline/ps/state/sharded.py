"""A state kept in slices by K shards as one state, and back: parameters and per-parameter optimizer tensors
concatenated in parameter order (so a checkpoint does not depend on the shard count), the sparse tables'
parts side by side; and a whole state's optimizer sliced for one shard. Used by the sharded server
(``pipeline.ps.server.parameter_server``) and to read a checkpoint set written by the shards themselves
(``merge_checkpoint_parts``, given to ``pipeline.checkpoints.CheckpointStore``).
"""
from __future__ import annotations

from typing import Any

import torch

from pipeline.errors import PSError
from pipeline.ps.sparse.parts import merge_states


def merge_shard_states(states: list[dict]) -> dict[str, Any]:
    """One state from the shards' ``state_dict()``s, in shard order: parameters and per-parameter optimizer
    tensors concatenated (a checkpoint does not depend on the shard count), the sparse tables' parts side by
    side, the per-rank records of shard 0 (every shard keeps them alike)."""
    if len(states) == 1:
        return dict(states[0])
    return {"version": min(st["version"] for st in states), "params": torch.cat([st["params"] for st in states]),
            "optimizer": _merge_optimizer_states([st["optimizer"] for st in states],
                                                 [st["params"].numel() for st in states]),
            "optimizer_spec": states[0]["optimizer_spec"], "clocks": states[0]["clocks"],
            "steps_applied_by_rank": states[0]["steps_applied_by_rank"], **_merged_tables(states)}


def merge_checkpoint_parts(parts: list[dict], record: dict) -> dict[str, Any]:
    """The PS state of a checkpoint set (``pipeline.checkpoints``): its shards' parts merged, with the record."""
    for i, part in enumerate(parts):
        if part.get("part_format") != 1:
            raise PSError(f"checkpoint part {i} has format {part.get('part_format')}, this shardline reads 1")
    merged = merge_shard_states([{k: v for k, v in p.items() if k not in ("part_format", "saved_at")} for p in parts])
    return {**merged, **record}


def _merged_tables(states: list[dict]) -> dict:
    parts = [st["sparse"] for st in states if "sparse" in st]
    return {"sparse": merge_states(parts)} if parts else {}


def _merge_optimizer_states(states: list[dict], sizes: list[int]) -> dict:
    """Concatenate per-element state tensors (momentum, Adam moments); keep scalars (Adam's step) of
    shard 0, which every shard shares because each applies the same number of steps."""
    merged = {"param_groups": states[0]["param_groups"], "state": {}}
    for key, value in states[0]["state"].items():
        entry = {}
        for name, tensor in value.items():
            if isinstance(tensor, torch.Tensor) and tensor.numel() == sizes[0]:
                entry[name] = torch.cat([st["state"][key][name].reshape(-1) for st in states])
            else:
                entry[name] = tensor
        merged["state"][key] = entry
    return merged


def slice_optimizer_state(state: dict, total: int, start: int, end: int) -> dict:
    sliced = {"param_groups": state["param_groups"], "state": {}}
    for key, value in state["state"].items():
        sliced["state"][key] = {
            name: (t.reshape(-1)[start:end].clone() if isinstance(t, torch.Tensor) and t.numel() == total else t)
            for name, t in value.items()
        }
    return sliced
