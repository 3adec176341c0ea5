"""A synthetic click log from `spark.range` ids, as a mapInArrow body (vectorized numpy, no Python rows).

Every value is a function of (seed, row id) alone, never of how rows fall into partitions or Arrow
batches: row r's `uniforms_per_row` uniforms are Philox's counter-based stream from block
r * uniforms_per_row / 4 on, so a batch jumps straight to its first row. From them:

- n0..: double, loc_i + scale_i * z (z standard normal by Box-Muller; loc/scale seeded per column, so
  standardizing matters), null where the row's mask uniform < null_fraction;
- c0..: "c<j>_<id zero-padded>", the id drawn from a Zipf law over popularity ranks (inverse CDF), the
  ranks mapped to ids by a seeded permutation so popularity is not the id's order; c0 draws from
  big_vocab ids, the others from vocab;
- label: Bernoulli(sigmoid(logit)), logit = bias + SIGNAL * (z @ w + sum_j effect(j, id_j)): a fixed
  logistic teacher over the (un-nulled) numeric values plus a per-(column, id) N(0, 1/sqrt(categorical))
  effect derived by hashing (seed, column, id), so no table has to travel with the config.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

ID = "id"
LABEL = "label"
# Bump when the generator's output for a given config changes, so landed data is regenerated.
VERSION = 1
# Scale of both parts of the teacher's logit; bias sets the click rate to roughly 30%.
SIGNAL = 1.5
BIAS = -1.0
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def numeric_name(i: int) -> str:
    return f"n{i}"


def categorical_name(j: int) -> str:
    return f"c{j}"


def column_vocab(j: int, vocab: int, big_vocab: int) -> int:
    return big_vocab if j == 0 else vocab


def id_width(vocab: int) -> int:
    return max(5, len(str(vocab - 1)))


def output_schema_ddl(numeric: int, categorical: int) -> str:
    columns = [f"{ID} bigint"] + [f"{numeric_name(i)} double" for i in range(numeric)]
    columns += [f"{categorical_name(j)} string" for j in range(categorical)]
    return ", ".join(columns + [f"{LABEL} bigint"])


def _seed64(seed: int) -> int:
    return seed % 2**64


def teacher(numeric: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loc, scale, weight) of each numeric column: the same seed gives the same columns everywhere."""
    rng = np.random.default_rng(np.random.SeedSequence([_seed64(seed), 0xC11C5]))
    loc = rng.normal(0.0, 3.0, numeric)
    scale = 10.0 ** rng.uniform(-1.0, 2.0, numeric)
    weight = rng.standard_normal(numeric) / np.sqrt(max(numeric, 1))
    return loc, scale, weight


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mix (SplitMix64's finalizer) on uint64 arrays; arithmetic wraps mod 2**64."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def category_effect(j: int, ids: np.ndarray, seed: int, std: float) -> np.ndarray:
    """The teacher's N(0, std) effect of id `ids` in column j: two hashes of (seed, j, id), Box-Muller."""
    with np.errstate(over="ignore"):
        key = np.uint64(_seed64(seed)) ^ (np.uint64(j + 1) * _GOLDEN)
        h1 = _splitmix64(ids.astype(np.uint64) ^ key)
        h2 = _splitmix64(h1)
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return std * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


@functools.lru_cache(maxsize=8)
def zipf_sampler(vocab: int, exponent: float) -> tuple[np.ndarray, np.ndarray]:
    """(CDF over popularity ranks, guide table): guide[b] is the rank of u = b / len(guide-1), so a u
    whose bucket starts and ends on the same rank needs no search; only the others are searched."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    buckets = 1 << min(22, max(10, int(np.ceil(np.log2(4 * vocab)))))
    guide = np.searchsorted(cdf, np.arange(buckets + 1, dtype=np.float64) / buckets, side="right")
    return cdf, np.minimum(guide, vocab - 1).astype(np.int32)


def zipf_ranks(u: np.ndarray, cdf: np.ndarray, guide: np.ndarray) -> np.ndarray:
    """The 0-based rank of each uniform u in [0, 1): the inverse CDF, exactly. u * buckets is exact (a
    power of two), so bucket b holds [b, b+1) / buckets and its answer lies in guide[b]..guide[b+1]."""
    bucket = (u * (len(guide) - 1)).astype(np.int64)
    rank = guide[bucket].astype(np.int64)
    searched = rank != guide[bucket + 1]
    if searched.any():
        rank[searched] = np.searchsorted(cdf, u[searched], side="right")
    return np.minimum(rank, len(cdf) - 1)


@functools.lru_cache(maxsize=2048)
def _column_tables(j: int, vocab: int, seed: int, std: float) -> tuple[np.ndarray, np.ndarray]:
    """(the value of each popularity rank as fixed-width text bytes [vocab, length], the teacher's
    effect of each rank's id) for column j; ranks map to ids by a seeded permutation.

    Cached per Python worker (reused workers keep them across tasks): a row's text and effect are
    then one lookup by rank instead of formatting and hashing every row."""
    rng = np.random.default_rng(np.random.SeedSequence([_seed64(seed), 0xC11C6, j]))
    ids = rng.permutation(vocab).astype(np.int64)
    return fixed_width_chars(f"{categorical_name(j)}_", ids, id_width(vocab)), category_effect(j, ids, seed, std)


def fixed_width_chars(prefix: str, ids: np.ndarray, width: int) -> np.ndarray:
    """prefix + each id zero-padded to `width` digits, as uint8 [len(ids), len(prefix) + width]."""
    head = prefix.encode()
    chars = np.empty((len(ids), len(head) + width), dtype=np.uint8)
    chars[:, :len(head)] = np.frombuffer(head, dtype=np.uint8)
    rest = ids.astype(np.int64)
    for k in range(len(head) + width - 1, len(head) - 1, -1):
        chars[:, k] = rest % 10 + 48
        rest = rest // 10
    return chars


def strings_from_chars(chars: np.ndarray) -> pa.Array:
    """A string array over the rows of a uint8 [n, length] array (one buffer: the offsets are a stride)."""
    n, length = chars.shape
    offsets = np.arange(0, (n + 1) * length, length, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(chars)])


def uniforms_per_row(numeric: int, categorical: int) -> int:
    """Box-Muller pairs for the numerics, a null mask per numeric, a rank per categorical, the label;
    padded to Philox's 4-draw block so a row starts on a block boundary."""
    needed = 2 * ((numeric + 1) // 2) + numeric + categorical + 1
    return -(-needed // 4) * 4


def make_generate_fn(numeric: int, categorical: int, vocab: int, big_vocab: int, zipf: float,
                     null_fraction: float, seed: int
                     ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    loc, scale, weight = teacher(numeric, seed)
    width = uniforms_per_row(numeric, categorical)
    pairs = (numeric + 1) // 2
    std = 1.0 / np.sqrt(max(categorical, 1))
    names = [ID] + [numeric_name(i) for i in range(numeric)] + [categorical_name(j) for j in range(categorical)]
    names.append(LABEL)

    def rows(first: int, n: int) -> list[pa.Array]:
        bits = np.random.Philox(key=_seed64(seed))
        bits.advance(first * (width // 4))
        u = np.random.Generator(bits).random((n, width))
        radius = np.sqrt(-2.0 * np.log1p(-u[:, :pairs]))  # 1 - u in (0, 1]
        angle = 2.0 * np.pi * u[:, pairs:2 * pairs]
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)[:, :numeric]
        logit = z @ weight
        masks = u[:, 2 * pairs:2 * pairs + numeric] < null_fraction
        columns = [pa.array(np.arange(first, first + n, dtype=np.int64))]
        values = loc + scale * z
        columns += [pa.array(values[:, i], mask=masks[:, i]) for i in range(numeric)]
        base = 2 * pairs + numeric
        for j in range(categorical):
            v = column_vocab(j, vocab, big_vocab)
            rank = zipf_ranks(u[:, base + j], *zipf_sampler(v, zipf))
            chars, effects = _column_tables(j, v, seed, std)
            logit += effects[rank]
            columns.append(strings_from_chars(chars[rank]))
        p = 1.0 / (1.0 + np.exp(-(BIAS + SIGNAL * logit)))
        columns.append(pa.array((u[:, -1] < p).astype(np.int64)))
        return columns

    def generate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            ids = batch.column(0).to_numpy()
            if len(ids) == 0:
                continue
            first = int(ids[0])
            # spark.range gives each batch consecutive ids; the counter jump relies on it.
            if int(ids[-1]) - first + 1 != len(ids):
                raise ValueError(f"clicks: batch ids are not consecutive ({first}..{int(ids[-1])}, {len(ids)} rows)")
            yield pa.RecordBatch.from_arrays(rows(first, len(ids)), names=names)

    return generate
