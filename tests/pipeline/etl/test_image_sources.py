"""The digits_images source (the digits as PNG bytes) and the PNG-files form for image.source=path."""
import io

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from pipeline.config import build
from pipeline.config.loader import load
from pipeline.config.workdir import Workdir
from pipeline.etl.digits import DIGITS_ID, land_digits, land_digits_images, write_digits_png_files
from pipeline.etl.sources import builtin_id_column, digits_images_raw_path, digits_raw_path, read_source
from pipeline.etl.split import SPLIT_COLUMN, assign_split


def _cfg(tmp_path, source):
    return build({"name": "d", "workdir": str(tmp_path), "data": {"source": source}})


def _decode(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "L" and image.size == (8, 8)
    return np.asarray(image)


def test_digits_images_are_the_digits_pixels_as_png(spark, tmp_path):
    images_cfg, digits_cfg = _cfg(tmp_path, "digits_images"), _cfg(tmp_path, "digits")
    frame = read_source(spark, images_cfg.data, images_cfg.workdir)
    path = digits_images_raw_path(images_cfg.data, images_cfg.workdir)
    assert path == Workdir.of(images_cfg).raw_digits_images and path.name == "digits_images"
    assert dict(frame.dtypes) == {"image_id": "bigint", "image": "binary", "label": "bigint"}

    images = pq.read_table(path).sort_by(DIGITS_ID)
    digits = pq.read_table(land_digits(digits_raw_path(digits_cfg.data, digits_cfg.workdir))).sort_by(DIGITS_ID)
    assert images.num_rows == digits.num_rows == 1797
    assert images.column(DIGITS_ID).equals(digits.column(DIGITS_ID))
    assert images.column("label").equals(digits.column("label"))
    decoded = np.stack([_decode(png) for png in images.column("image").to_pylist()])
    pixels = np.column_stack([digits.column(f"pixel_{i:02d}").to_numpy() for i in range(64)]).reshape(-1, 8, 8)
    assert decoded.dtype == np.uint8
    assert np.array_equal(decoded, np.clip(pixels * 16, 0, 255).astype(np.uint8))
    assert decoded.max() == 255 and decoded.min() == 0  # 16 * 16 clipped, and blank background

    # Landed once: a second read reuses the same file.
    stamp = (path / "part-00000.parquet").stat().st_mtime_ns
    assert read_source(spark, images_cfg.data, images_cfg.workdir).count() == 1797
    assert (path / "part-00000.parquet").stat().st_mtime_ns == stamp


def test_digits_and_digits_images_split_the_same_images(spark, tmp_path, conf_dir):
    assert builtin_id_column("digits") == builtin_id_column("digits_images") == DIGITS_ID
    assert load(f"{conf_dir}/digits_cnn.yaml").data.id_column == DIGITS_ID
    splits = {}
    for source in ("digits", "digits_images"):
        cfg = _cfg(tmp_path, source)
        frame = assign_split(read_source(spark, cfg.data, cfg.workdir), [DIGITS_ID], cfg.data.split)
        splits[source] = {(r[DIGITS_ID], r[SPLIT_COLUMN]) for r in frame.select(DIGITS_ID, SPLIT_COLUMN).collect()}
    assert splits["digits"] == splits["digits_images"]
    test_ids = {i for i, s in splits["digits"] if s == "test"}
    assert 150 < len(test_ids) < 400  # the configured 15%, give or take the hash


def test_png_files_with_a_path_column(spark, tmp_path):
    table_dir = write_digits_png_files(tmp_path / "files", limit=50)
    frame = spark.read.parquet(str(table_dir))
    assert dict(frame.dtypes) == {"image_id": "bigint", "path": "string", "label": "bigint"}
    rows = sorted(frame.collect(), key=lambda r: r[DIGITS_ID])
    assert [r[DIGITS_ID] for r in rows] == list(range(50))
    landed = pq.read_table(land_digits_images(tmp_path / "raw" / "digits_images")).sort_by(DIGITS_ID).slice(0, 50)
    assert [r["label"] for r in rows] == landed.column("label").to_pylist()
    for row, png in zip(rows, landed.column("image").to_pylist()):
        with open(row["path"], "rb") as f:
            assert np.array_equal(_decode(f.read()), _decode(png))
    # A data.source=parquet config over it takes the image feature in its path form.
    cfg = build({"workdir": str(tmp_path), "data": {"source": "parquet", "path": str(table_dir), "id_column": DIGITS_ID,
                 "features": [{"name": "path", "type": "image", "height": 8, "width": 8, "channels": 1,
                               "source": "path"}]}})
    assert read_source(spark, cfg.data, cfg.workdir).count() == 50


def test_digits_cnn_config(conf_dir):
    cfg = load(f"{conf_dir}/digits_cnn.yaml")
    assert cfg.data.source == "digits_images" and cfg.model.kind == "cnn" and cfg.data.label == "label"
    (image,) = cfg.data.features
    assert (image.name, image.type, image.height, image.width, image.channels, image.source) == \
        ("image", "image", 8, 8, 1, "bytes")
