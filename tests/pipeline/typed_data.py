"""A small source with a column of every feature type (and learnable labels), and its typed config."""
from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config.loader import build, deep_merge, read_yaml

ROWS = 600

FEATURES = [
    {"name": "amount", "type": "numeric", "impute": "median"},
    {"name": "city", "type": "categorical", "min_count": 3},
    {"name": "shop", "type": "categorical", "hash_buckets": 64},
    {"name": "vec", "type": "vector", "length": 3},
    {"name": "img", "type": "image", "height": 4, "width": 4, "channels": 1},
    {"name": "title", "type": "text", "max_len": 3},
]


def png(value: int, size=(6, 5)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full(size[::-1], value, dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def write_typed_source(path, rows=ROWS, *, bad_image_rows=(), short_vector_rows=(), seed=0) -> str:
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, rows)
    amount = rng.normal(10, 2, rows)
    amount_list = [None if i % 10 == 0 else float(v) for i, v in enumerate(amount)]
    city = [None if i % 50 == 0 else f"city{int(v)}" for i, v in enumerate(rng.zipf(1.5, rows) % 30)]
    shop = (rng.integers(0, 5, rows) * 7).astype(np.int64)
    vec = [[float(i), float(i) / 2, 1.0] for i in range(rows)]
    for i in short_vector_rows:
        vec[i] = [1.0]
    images = [png(int(v) * 100) for v in label]
    for i in bad_image_rows:
        images[i] = b"not an image"
    words = ["red apple", "green Apple, pear", None, "banana"]
    text = [words[i % 4] for i in range(rows)]
    table = pa.table({"id": np.arange(rows), "amount": pa.array(amount_list, pa.float64()),
                      "city": pa.array(city, pa.string()), "shop": shop,
                      "vec": pa.array(vec, pa.list_(pa.float64())), "img": pa.array(images, pa.binary()),
                      "title": pa.array(text, pa.string()), "label": label})
    os.makedirs(path, exist_ok=True)
    pq.write_table(table, os.path.join(path, "part-0.parquet"))
    return str(path)



def typed_config(conf_dir, tmp_path, source, features=FEATURES, *, name="typed", **data):
    raw = deep_merge(read_yaml(os.path.join(conf_dir, "base.yaml")), {
        "name": name, "workdir": str(tmp_path / "work"),
        "data": {"source": "parquet", "path": source, "features": features, "id_column": "id", **data},
        "parallelism": {"data": 2}, "train": {"batch_size": 16}})
    return build(raw)
