"""The bundled digits sources: scikit-learn's 1,797 handwritten 8x8 digits, landed once as raw Parquet.

`digits` lands them as 64 float pixel columns; `digits_images` as PNG bytes (8x8 grayscale, the 0..16
pixel value times 16, clipped to 255) for the typed `image` feature. Both carry the same `image_id`
(int64, 0..1796) and label, so the id-hash split puts the same images in the same split for either
source. `write_digits_png_files` writes the PNGs as files plus a table of their paths, for
`image.source: path`.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from pipeline.config.schema import DataConfig
from pipeline.config.workdir import hidden_sibling, raw_digits, raw_digits_images

log = logging.getLogger(__name__)

DIGITS_ID = "image_id"
IMAGE_COLUMN = "image"
PATH_COLUMN = "path"


def digits_raw_path(data: DataConfig, workdir: str) -> Path:
    return raw_digits(data, workdir)


def digits_images_raw_path(data: DataConfig, workdir: str) -> Path:
    return raw_digits_images(data, workdir)


def _land_table(table, target: Path, what: str) -> Path:
    """Write `table` as target/part-00000.parquet + _SUCCESS via a hidden staging folder renamed into
    place, so a reader never sees a half-written copy and a crash leaves nothing that looks landed."""
    import pyarrow.parquet as pq

    staging = hidden_sibling(target, "tmp", hex_chars=8)
    staging.mkdir(parents=True)
    try:
        pq.write_table(table, staging / "part-00000.parquet")
        (staging / "_SUCCESS").touch()
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("landed %d %s as raw Parquet in %s", table.num_rows, what, target)
    return target


def land_digits(target: Path) -> Path:
    """Write the digits as 64 pixel columns (float64, 0..16) + label, atomically, once."""
    if (target / "_SUCCESS").exists():
        return target
    import numpy as np
    import pyarrow as pa
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = digits.data.astype(np.float64)
    columns = {DIGITS_ID: pa.array(np.arange(len(pixels), dtype=np.int64))}
    columns.update({f"pixel_{i:02d}": pa.array(pixels[:, i]) for i in range(pixels.shape[1])})
    columns["label"] = pa.array(digits.target.astype(np.int64))
    return _land_table(pa.table(columns), target, "digits images")


def digit_pixels():
    """(uint8 [1797, 8, 8] grayscale images, int64 labels): the 0..16 values scaled to 0..255."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(digits.images * 16, 0, 255).astype(np.uint8)
    return images, digits.target.astype(np.int64)


def encode_png(image) -> bytes:
    """One uint8 [H, W] (grayscale) or [H, W, 3] (RGB) array as PNG bytes."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def land_digits_images(target: Path) -> Path:
    """Write the digits as PNG bytes: image_id (int64), image (binary PNG), label (int64); atomically, once."""
    if (target / "_SUCCESS").exists():
        return target
    import numpy as np
    import pyarrow as pa

    images, labels = digit_pixels()
    table = pa.table({DIGITS_ID: pa.array(np.arange(len(images), dtype=np.int64)),
                      IMAGE_COLUMN: pa.array([encode_png(im) for im in images], type=pa.binary()),
                      "label": pa.array(labels)})
    return _land_table(table, target, "digits PNG images")


def write_digits_png_files(folder: Path, limit: Optional[int] = None) -> Path:
    """The digits as PNG files under folder/images/ and a Parquet table (image_id, path, label) under
    folder/table/, whose `path` column holds each file's absolute path; returns the table's folder (a
    data.path for data.source=parquet with an image feature of source: path). `limit`: the first N only."""
    import numpy as np
    import pyarrow as pa

    images, labels = digit_pixels()
    count = len(images) if limit is None else min(limit, len(images))
    image_dir = (folder / "images").absolute()
    image_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = image_dir / f"{i:04d}.png"
        path.write_bytes(encode_png(images[i]))
        paths.append(str(path))
    table = pa.table({DIGITS_ID: pa.array(np.arange(count, dtype=np.int64)),
                      PATH_COLUMN: pa.array(paths, type=pa.string()), "label": pa.array(labels[:count])})
    return _land_table(table, folder / "table", "digits PNG file paths")
