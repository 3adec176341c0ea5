"""Id hashing for sparse tables: which row shard owns an id, and each row's reproducible initial value.

Why a counter-based hash instead of a seeded torch generator: a row must get the same initial value
whichever server shard, process or run creates it, and whenever it is first touched (or recreated after
an eviction), so the value may depend on nothing but (table seed, id, column). splitmix64's finalizer
mixes well enough for both uses and vectorises over numpy ``uint64`` arrays (wrapping multiplication,
logical shifts), so no Python loop runs per id. A served model recomputes the same rows with numpy alone
(``pipeline.ps.sparse.artifact``).
"""
from __future__ import annotations

import hashlib

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TWO_PI = 2.0 * np.pi


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over int64/uint64 values (a fresh uint64 array)."""
    z = np.ascontiguousarray(values).view(np.uint64).copy() if values.dtype == np.int64 else \
        np.asarray(values, dtype=np.uint64).copy()
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def table_seed(name: str, seed: int) -> int:
    """A table's 64-bit seed from its name and the run's seed (stable across Python processes)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_of(ids: np.ndarray, shards: int, stride: int = 1) -> np.ndarray:
    """Shard of each id: ``mix64(id) // stride % shards`` (mixed first, so sequential ids spread evenly).

    ``stride``: the number of server shards the rows are first split over (``mix64(id) % stride``), so the
    row shards inside one server shard use other bits of the hash, not the ones every id there shares."""
    if shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    mixed = mix64(ids)
    if stride > 1:
        mixed //= np.uint64(stride)
    return (mixed % np.uint64(shards)).astype(np.int64)


def _unit(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in (0, 1): the top 53 bits, centred in their interval."""
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def init_rows(seed: int, ids: np.ndarray, dim: int, std: float) -> np.ndarray:
    """float32 [len(ids), dim]: N(0, std^2) per (seed, id, column) by Box-Muller over two hashes."""
    base = mix64(np.asarray(ids, dtype=np.int64) ^ np.int64(np.uint64(seed).view(np.int64)))
    cols = np.arange(dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        first = mix64(base[:, None] + (np.uint64(2) * cols + np.uint64(1)) * _GOLDEN)
        second = mix64(base[:, None] + (np.uint64(2) * cols + np.uint64(2)) * _GOLDEN)
    radius = np.sqrt(-2.0 * np.log(_unit(first)))
    return (std * radius * np.cos(_TWO_PI * _unit(second))).astype(np.float32)
