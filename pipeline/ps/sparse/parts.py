"""The sparse tables of several server shards as one: their states and stats merged, a state split again.

A checkpoint holds every part's row shards side by side (``merge_states``), which a table of any split
loads (``SparseTable.load_state_dict`` re-routes rows and keeps its part's), so a checkpoint does not depend
on where the rows lived; ``split_state`` sends each part only its own rows (a restore moves each row once).
"""
from __future__ import annotations

from typing import Any


def merge_states(states: list[dict]) -> dict:
    """One ``SparseStore.state_locked()`` from the parts' (each table's row shards side by side)."""
    merged: dict[str, Any] = {}
    for state in states:
        for name, table in state.items():
            entry = merged.setdefault(name, {**table, "shards": []})
            entry["shards"] = entry["shards"] + list(table["shards"])
    return merged


def split_state(state: dict, parts: int) -> list[dict]:
    """``state`` (any split's) as one state per part, each with only the rows that part owns."""
    import numpy as np
    import torch

    from pipeline.ps.sparse.table import owner_of

    out: list[dict] = [{} for _ in range(parts)]
    for name, table in state.items():
        for p in range(parts):
            out[p][name] = {**table, "shards": []}
        for k, shard in enumerate(table["shards"]):
            owners = owner_of(shard["ids"].numpy(), parts)
            for p in range(parts):
                keep = torch.from_numpy(np.flatnonzero(owners == p))
                out[p][name]["shards"].append({
                    **shard, "ids": shard["ids"][keep], "rows": shard["rows"][keep],
                    "state": {n: t[keep] for n, t in shard["state"].items()}, "last_seen": shard["last_seen"][keep],
                    # candidates and counters are the table's: kept once, with part 0
                    **({} if p == 0 else {"cand_ids": shard["cand_ids"][:0], "cand_counts": shard["cand_counts"][:0],
                                          "counts": {}}),
                })
    return out


def merge_stats(stats: list[dict]) -> dict:
    """One ``SparseStore.stats_locked()`` from the parts': every counter summed, per table too."""
    merged: dict[str, Any] = {}
    for part in stats:
        for key, value in part.items():
            if key == "tables":
                tables = merged.setdefault("tables", {})
                for name, counts in value.items():
                    into = tables.setdefault(name, {})
                    for k, v in counts.items():
                        into[k] = into.get(k, 0) + v
            else:
                merged[key] = merged.get(key, 0) + value
    return merged
