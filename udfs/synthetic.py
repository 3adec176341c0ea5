"""Learnable synthetic rows from `spark.range` ids, as a mapInArrow body (vectorized, no Python rows).

Features are standard normal float32; the label comes from a fixed random teacher network
(tanh hidden layer, seeded) plus Gaussian noise: argmax of its outputs for classification, its first
output for regression. Each Arrow batch draws from a generator seeded by (seed, first id of the batch),
so the same (rows, partitions, seed) always gives the same data.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

ID = "id"


def feature_name(i: int, width: int) -> str:
    return f"f_{i:0{max(3, len(str(width - 1)))}d}"


def output_schema_ddl(features: int, classification: bool) -> str:
    columns = [f"{ID} bigint"] + [f"{feature_name(i, features)} float" for i in range(features)]
    return ", ".join(columns + [f"label {'bigint' if classification else 'double'}"])


def teacher(features: int, hidden: int, outputs: int, seed: int) -> tuple[np.ndarray, ...]:
    """The fixed teacher's weights: the same seed gives the same network everywhere."""
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, 0xFEED]))
    w1 = (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32)
    b1 = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, outputs)) * 2.0 / np.sqrt(hidden)).astype(np.float32)
    return w1, b1, w2


def make_generate_fn(features: int, classes: int, hidden: int, noise: float, seed: int,
                     classification: bool) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    outputs = classes if classification else 1
    w1, b1, w2 = teacher(features, hidden, outputs, seed)
    names = [ID] + [feature_name(i, features) for i in range(features)] + ["label"]

    def generate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            ids = batch.column(0).to_numpy()
            if len(ids) == 0:
                continue
            rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, int(ids[0])]))
            x = rng.standard_normal((len(ids), features), dtype=np.float32)
            out = np.tanh(x @ w1 + b1) @ w2
            if noise:
                out += noise * rng.standard_normal(out.shape, dtype=np.float32)
            label = pa.array(out.argmax(axis=1).astype(np.int64)) if classification else \
                pa.array(out[:, 0].astype(np.float64))
            # Column-major copy once, so each feature column is a contiguous zero-copy slice.
            columns = np.asfortranarray(x)
            yield pa.RecordBatch.from_arrays(
                [pa.array(ids)] + [pa.array(columns[:, i]) for i in range(features)] + [label], names=names)

    return generate
