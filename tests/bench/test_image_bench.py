"""bench/image_bench.py's data and plain-loop parts on a handful of tiny images: deterministic, decodable,
varied (so they compress like images, not like flat colour), landed as raw Parquet once. No Spark, no
timing asserts."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("image_bench")


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_images_decode_deterministically(bench, fmt):
    from udfs.transforms import decode_images

    data, labels = bench.make_images(6, 16, fmt)
    again, _ = bench.make_images(3, 16, fmt, start=3)
    assert data[3:] == again  # image i depends on (seed, i) only
    assert len(set(data)) == 6 and all(0 <= y < bench.CLASSES for y in labels)
    pixels, bad, error = decode_images(data, 16, 16, 3)
    assert pixels.shape == (6, 3, 16, 16) and not bad.any() and error is None
    assert pixels.std() > 10  # varied content, not a flat colour
    assert bench.bench_plain([data[:3], data[3:]], 16) > 0


def test_land_raw_once(bench, tmp_path):
    import pyarrow.parquet as pq

    raw = bench.land_raw(tmp_path, 5, 16, "jpeg", 90, files=2)
    table = pq.read_table(raw)
    assert table.num_rows == 5 and table.column_names == ["id", "image", "label"]
    assert sorted(table.column("id").to_pylist()) == list(range(5))
    stamp = (raw / "_SUCCESS").stat().st_mtime_ns
    assert bench.land_raw(tmp_path, 5, 16, "jpeg", 90, files=2) == raw
    assert (raw / "_SUCCESS").stat().st_mtime_ns == stamp  # reused, not rewritten
