"""A synthetic click log from `spark.range` ids, as a mapInArrow body (vectorized numpy, no Python rows).

Every value is a function of (seed, row id) alone, never of how rows fall into partitions or Arrow
batches: row r's `uniforms_per_row` uniforms are Philox's counter-based stream from block
r * uniforms_per_row / 4 on, so a batch jumps straight to its first row. From them:

- n0..: double, loc_i + scale_i * z (z standard normal by Box-Muller; loc/scale seeded per column, so
  standardizing matters), null where the row's mask uniform < null_fraction;
- c0..: "c<j>_<id zero-padded>", the id drawn from a Zipf law over popularity ranks (inverse CDF: exact
  over the first ZIPF_HEAD ranks, an integral approximation beyond them), the rank mapped to an id by a
  seeded Feistel bijection on [0, vocab) so popularity is not the id's order; c0 draws from big_vocab
  ids, the others from vocab;
- label: Bernoulli(sigmoid(logit)), logit = bias + SIGNAL * (z @ w + sum_j effect(j, id_j)): a fixed
  logistic teacher over the (un-nulled) numeric values plus a per-(column, id) N(0, 1/sqrt(categorical))
  effect derived by hashing (seed, column, id), so no table has to travel with the config.

Nothing is stored per id or per rank beyond the Zipf head, so a worker's memory is the same whether a
column has 10^4 or 10^9 ids (per-rank tables peaked at 5.2 GiB at vocab 10^7 x 26 columns); the price is
hashing and formatting every row's id instead of looking it up.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa

ID = "id"
LABEL = "label"
# Bump when the generator's output for a given config changes, so landed data is regenerated.
# 2: ranks map to ids by a Feistel bijection (was a stored permutation), ranks past ZIPF_HEAD come from an
# integral approximation of the CDF, and the effect's Box-Muller angle is float32 (values move < 3e-7).
VERSION = 2
# Scale of both parts of the teacher's logit; bias sets the click rate to roughly 30%.
SIGNAL = 1.5
BIAS = -1.0
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Ranks whose Zipf CDF is tabulated exactly: 0.5 MB of CDF and 4 MB of guide per (vocab, zipf) at most.
ZIPF_HEAD = 1 << 16
# Feistel rounds of the rank -> id bijection: each half is hashed into the other twice, so neighbouring
# ranks land on unrelated ids.
_ROUNDS = 4


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
    """A bijective 64-bit mix (SplitMix64's finalizer) of a uint64 array, in place (every row's id is
    hashed, so the temporaries count); arithmetic wraps mod 2**64."""
    x += _GOLDEN
    t = x >> np.uint64(30)
    x ^= t
    x *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(x, np.uint64(27), out=t)
    x ^= t
    x *= np.uint64(0x94D049BB133111EB)
    np.right_shift(x, np.uint64(31), out=t)
    x ^= t
    return x


def category_effect(j: int, ids: np.ndarray, seed: int, std: float) -> np.ndarray:
    """The teacher's N(0, std) effect of id `ids` in column j: two hashes of (seed, j, id), Box-Muller.
    The cosine is taken in float32: numpy's float64 cos has no SIMD path (~40x slower, and it runs on
    every row of every column), and an effect needs no more than float32's precision in its angle."""
    key = np.uint64((_seed64(seed) ^ ((j + 1) * int(_GOLDEN))) % 2**64)
    h1 = ids.astype(np.uint64)
    h1 ^= key
    _splitmix64(h1)
    h2 = _splitmix64(h1.copy())
    u1 = (h1 >> np.uint64(11)).astype(np.float64)
    u1 += 1.0  # (0, 1] after scaling: log is finite
    u1 *= 2.0**-53
    angle = (h2 >> np.uint64(40)).astype(np.float32)
    angle *= np.float32(2.0 * np.pi * 2.0**-24)
    np.log(u1, out=u1)
    u1 *= -2.0 * std * std
    np.sqrt(u1, out=u1)
    u1 *= np.cos(angle)
    return u1


class ZipfSampler(NamedTuple):
    cdf: np.ndarray  # exact CDF of the first min(vocab, ZIPF_HEAD) ranks, normalized over all vocab ranks
    guide: np.ndarray  # guide[b]: the rank of u = b / (len(guide) - 1)
    vocab: int
    exponent: float
    head_sum: float  # sum of k ** -exponent over the tabulated ranks k = 1..len(cdf)
    norm: float  # head_sum + the tail's integral: the law's normalizer


def _tail_integral(y: float, start: float, exponent: float) -> float:
    """The integral of x ** -exponent from start to y, in a form that stays accurate as exponent -> 1."""
    log_ratio = np.log(y / start)
    if exponent == 1.0:
        return float(log_ratio)
    return float(start ** (1.0 - exponent) * np.expm1((1.0 - exponent) * log_ratio) / (1.0 - exponent))


@functools.lru_cache(maxsize=4)
def zipf_sampler(vocab: int, exponent: float) -> ZipfSampler:
    """The inverse-CDF tables of a Zipf law over `vocab` ranks, of a size bounded by ZIPF_HEAD whatever
    the vocab (a CDF of every rank took 80 MB and its guide 16 MB at vocab 10**7).

    Past the head, the sum of k ** -s over ranks H+1..k is taken as the midpoint-rule integral of x ** -s
    from H + 1/2 to k + 1/2 (Euler-Maclaurin's leading term), which inverts in closed form. As
    f'' = s(s+1) x**(-s-2) > 0, each rank's integral exceeds its term by at most ~s(s+1) / (24 (k - 1/2)**2)
    of it, and so do the tail's CDF values and the normalizer: with H = 2**16, under 2.3e-11 relatively
    at s = 1.1 and 1.1e-9 at s = 10 (the config's cap). Measured against the exact per-rank probabilities
    at vocab = 10**6 (max relative error, tail ranks): 6.7e-12 at s = 0.5, 1.9e-11 at s = 1, 2.2e-11 at
    s = 1.1, 5.8e-11 at s = 2, 1.1e-9 at s = 10; uniforms drawn in the tail got the exact (long double)
    inverse CDF's rank except 5e-7 (s = 1.1) and 9e-6 (s = 2) of them, one rank off. From s ~ 3 on the
    tail's mass (1e-10) nears float64's resolution of u and ranks there are approximate, as they were
    (worse: by up to 8e5 ranks) with the full float64 table."""
    head = min(vocab, ZIPF_HEAD)
    cdf = np.cumsum(np.arange(1, head + 1, dtype=np.float64) ** -exponent)
    head_sum = float(cdf[-1])
    norm = head_sum + (_tail_integral(vocab + 0.5, head + 0.5, exponent) if vocab > head else 0.0)
    cdf /= norm
    # 16+ buckets a rank: ~5% of the draws straddle a rank and need the binary search (~100 ns each).
    buckets = 1 << min(20, max(10, int(np.ceil(np.log2(16 * head)))))
    guide = np.searchsorted(cdf, np.arange(buckets + 1, dtype=np.float64) / buckets, side="right")
    if vocab == head:
        guide = np.minimum(guide, vocab - 1)  # else a guide of `head` means "in the tail"
    return ZipfSampler(cdf, guide.astype(np.int32), vocab, exponent, head_sum, norm)


def _tail_ranks(u: np.ndarray, z: ZipfSampler) -> np.ndarray:
    """The 0-based rank of each u past the head: the integral approximation of the CDF, inverted."""
    s, start = z.exponent, len(z.cdf) + 0.5
    reach = np.maximum(u * z.norm - z.head_sum, 0.0) * start ** (s - 1.0)
    with np.errstate(divide="ignore", over="ignore"):
        if s == 1.0:
            log_ratio = reach
        else:
            # log1p keeps exponents near 1 exact; -1 is only reached by rounding at u -> 1 (the last rank).
            log_ratio = np.log1p(np.maximum((1.0 - s) * reach, -1.0)) / (1.0 - s)
        y = start * np.exp(np.minimum(log_ratio, np.log(z.vocab / start) + 1.0))
    # Rank k (1-based) holds the integral up to k + 1/2, so u falls in the first k with k + 1/2 > y.
    return np.floor(y - 0.5).astype(np.int64)


def zipf_ranks(u: np.ndarray, z: ZipfSampler) -> np.ndarray:
    """The 0-based rank of each uniform u in [0, 1); exactly the inverse CDF over the head. u * buckets is
    exact (a power of two), so bucket b holds [b, b+1) / buckets and its answer lies in guide[b]..guide[b+1]:
    a bucket that starts and ends on the same rank needs no search."""
    bucket = (u * (len(z.guide) - 1)).astype(np.int64)
    rank = z.guide[bucket].astype(np.int64)
    searched = rank != z.guide[bucket + 1]
    if searched.any():
        rank[searched] = np.searchsorted(z.cdf, u[searched], side="right")
    if z.vocab > len(z.cdf):
        tail = np.flatnonzero(rank >= len(z.cdf))
        if tail.size:
            rank[tail] = _tail_ranks(u[tail], z)
    return np.minimum(rank, z.vocab - 1)


def id_keys(j: int, seed: int) -> np.ndarray:
    """Column j's Feistel round keys, [_ROUNDS, 2] uint64: an offset and an odd multiplier per round."""
    keys = np.random.SeedSequence([_seed64(seed), 0xC11C6, j]).generate_state(2 * _ROUNDS, np.uint64)
    keys[1::2] |= np.uint64(1)
    return keys.reshape(_ROUNDS, 2)


def _id_radices(vocab: int) -> tuple[int, int]:
    """(a, b): the Feistel's halves take a and b values, a * b >= vocab with less than b to spare."""
    b = math.isqrt(vocab - 1) + 1
    return -(-vocab // b), b


def _feistel(x: np.ndarray, a: int, b: int, keys: np.ndarray) -> np.ndarray:
    """A permutation of [0, a * b) (x = left * b + right): each round adds to one half, mod its radix, a
    hash of the other, which is invertible whatever the hash. Mixed radices rather than bit halves keep
    the domain within sqrt(vocab) of vocab, so cycle walking is rare: over a power of two up to half of
    the values walk and a batch paid ~10 rounds of Python-level numpy calls for the last few of them.

    The hash is multiply-shift (the product's top half depends on every bit of the offset input), scaled
    to [0, radix) by a second multiply-shift. In uint32 when both radices fit 16 bits (vocab <= 2**32):
    numpy multiplies uint32 lanes about twice as fast. Arithmetic wraps, and min(t, t - m) is t mod m for
    t < 2m because t - m wraps past every t when t < m."""
    kind = np.uint32 if b <= 1 << 16 else np.uint64
    half = kind(16 if kind is np.uint32 else 32)
    left, right = np.divmod(x.astype(kind), kind(b))
    h = np.empty_like(left)
    for r, (offset, multiplier) in enumerate(keys.astype(kind)):
        source, target, radix = (right, left, kind(a)) if r % 2 == 0 else (left, right, kind(b))
        np.add(source, offset, out=h)
        h *= multiplier
        h >>= half
        h *= radix
        h >>= half
        target += h
        np.subtract(target, radix, out=h)
        np.minimum(target, h, out=target)
    left *= kind(b)
    left += right
    return left


def rank_ids(rank: np.ndarray, vocab: int, keys: np.ndarray) -> np.ndarray:
    """The id (int64) of each 0-based popularity rank: a seeded bijection on [0, vocab), so popularity
    does not follow id order and no table is stored. Cycle walking restricts the Feistel permutation of
    [0, a * b) to [0, vocab): a value past vocab is permuted again until it lands inside (the cycle
    through a rank inside comes back inside, so walks end, and distinct ranks keep distinct ids)."""
    a, b = _id_radices(vocab)
    ids = _feistel(rank, a, b, keys)
    todo = np.flatnonzero(ids >= vocab)
    while todo.size:
        walked = _feistel(ids[todo], a, b, keys)
        ids[todo] = walked
        todo = todo[walked >= vocab]
    return ids.astype(np.int64)


def fixed_width_chars(prefix: str, ids: np.ndarray, width: int) -> np.ndarray:
    """prefix + each id (0 <= id < 10 ** width) zero-padded to `width` digits, as uint8
    [len(ids), len(prefix) + width]. Ids under 10**9 are split into digits in uint32, which numpy divides
    by a constant ~3x faster than int64 (this runs on every row of every categorical column)."""
    head = prefix.encode()
    chars = np.empty((len(ids), len(head) + width), dtype=np.uint8)
    chars[:, :len(head)] = np.frombuffer(head, dtype=np.uint8)
    kind = np.uint32 if width <= 9 else np.uint64
    ten, zero = kind(10), kind(48)
    rest = ids.astype(kind)
    quotient = np.empty_like(rest)
    for k in range(len(head) + width - 1, len(head) - 1, -1):
        np.floor_divide(rest, ten, out=quotient)
        rest -= quotient * ten
        rest += zero
        chars[:, k] = rest
        rest, quotient = quotient, rest
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
    keys = [id_keys(j, seed) for j in range(categorical)]
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
            ids = rank_ids(zipf_ranks(u[:, base + j], zipf_sampler(v, zipf)), v, keys[j])
            logit += category_effect(j, ids, seed, std)
            columns.append(strings_from_chars(fixed_width_chars(f"{categorical_name(j)}_", ids, id_width(v))))
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
