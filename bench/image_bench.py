"""Image features, encoded vs decoded storage: the loader's decode throughput and the disk/speed trade-off.

    .venv/bin/python bench/image_bench.py [--images 20000] [--size 64] [--format jpeg|png] [--quality 90]
        [--workdir /tmp/shardline-image-bench] [--row-group 1024] [--buffer 4096] [--batch 256]
        [--threads 1 2 4] [--repeat 3] [--profile]

Not timed: `--images` RGB size x size images of varied content (a smooth random colour field, a few
random shapes, pixel noise: so JPEG/PNG compress realistically, ~2 KB per 64x64 JPEG) are generated
with numpy + PIL and landed as raw Parquet (id int64, image binary, label int64), once per spec. Then
the real ETL (`pipeline.etl.run_etl`, data.source=parquet, one image feature of source: bytes) runs
twice on one local[2] session (conf/base.yaml's spark section), storage: decoded and storage: encoded,
with parallelism.data=1 so one rank holds the whole train split (after an untimed warm-up ETL). The
figures, each a ratio of two measurements taken in this run, interleaved over --repeat rounds (best of
each):

  loader (encoded, T threads) / plain decode: images/s of `StreamingLoader` (rank 0, features =
      manifest.feature_set, reader_threads=T, row-group shuffle + shuffle buffer + prefetch) over the
      encoded train shards, divided by a plain single-thread loop calling `udfs.transforms.decode_images`
      on the same byte strings (held in memory, one call per row group). Target >= 0.9 at 1 thread.
  decoded loader / encoded loader (1 thread): the speed side of storing pixels.
  shard bytes decoded / encoded: the disk side (every split's shard files).
  ETL wall decoded / encoded.

Then a breakdown of the encoded loader at 1 thread, per image, in microseconds: the Parquet read of a
row group, Arrow -> Python bytes list (`to_pylist`), `decode_images`, and everything downstream of the
reader (shuffle buffer in/out, batch slicing, torch.from_numpy, the prefetch queue), the latter measured
by running the same loader with `read_row_group` answering from memory; decode_image's own steps
(Image.open, the codec's load, convert + asarray + transpose); and, for decoded storage, the read of one
row group's pixels as the shards store them (a Parquet LIST of uint8: INT32 values with repetition
levels) next to the same pixels as fixed_size_binary(C*H*W) in an in-memory Parquet file. --profile
adds a cProfile of the plain decode loop (where a decode's time goes inside PIL).

Row groups default to 1024 rows here: conf/base.yaml's 65,536 would put the rank's whole train split
(14k images, 170 MB of 64x64 RGB pixels) in one row group, leaving reader threads nothing to read ahead;
the shuffle buffer defaults to 4096 rows (50 MB of pixels) for the same reason.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMAGE = "image"
CLASSES = 10


# -- data --------------------------------------------------------------------------------------------
def make_images(count: int, size: int, fmt: str = "jpeg", quality: int = 90, seed: int = 0,
                start: int = 0) -> tuple[list[bytes], list[int]]:
    """`count` encoded RGB images (size x size) and labels; image i depends on (seed, start + i) only.

    Content: a smooth colour field (random 4x4..8x8 colours upscaled bicubic), 1-4 random filled
    rectangles/ellipses, Gaussian pixel noise (sigma 2..10): compresses like photos do, not like flat
    colour or white noise. Label: (number of shapes x 3 + the brightest mean channel) % 10."""
    import numpy as np
    from PIL import Image, ImageDraw

    out, labels = [], []
    options = {"format": "JPEG", "quality": quality} if fmt == "jpeg" else {"format": "PNG"}
    for i in range(start, start + count):
        rng = np.random.default_rng([seed, i])
        grid = int(rng.integers(4, 9))
        field = rng.integers(0, 256, (grid, grid, 3), dtype=np.uint8)
        image = Image.fromarray(field).resize((size, size), Image.BICUBIC)
        draw = ImageDraw.Draw(image)
        shapes = int(rng.integers(1, 5))
        for _ in range(shapes):
            x0, y0 = rng.integers(0, size, 2)
            w, h = rng.integers(size // 8, size // 2 + 1, 2)
            box = [int(x0), int(y0), int(min(size - 1, x0 + w)), int(min(size - 1, y0 + h))]
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
        pixels = np.asarray(image).astype(np.int16)
        pixels = pixels + rng.normal(0, rng.uniform(2, 10), pixels.shape).astype(np.int16)
        pixels = np.clip(pixels, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, **options)
        out.append(buffer.getvalue())
        labels.append((shapes * 3 + int(pixels.reshape(-1, 3).mean(axis=0).argmax())) % CLASSES)
    return out, labels


def land_raw(folder: Path, count: int, size: int, fmt: str, quality: int, files: int = 4) -> Path:
    """The images as raw Parquet (`files` files of id, image, label) under folder, once per spec."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    target = folder / f"raw-{count}x{size}-{fmt}{quality if fmt == 'jpeg' else ''}"
    if (target / "_SUCCESS").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    per_file = -(-count // files)
    for f in range(files):
        start, n = f * per_file, max(0, min(per_file, count - f * per_file))
        data, labels = make_images(n, size, fmt, quality, start=start)
        pq.write_table(pa.table({"id": pa.array(np.arange(start, start + n, dtype=np.int64)),
                                 IMAGE: pa.array(data, pa.binary()), "label": pa.array(labels, pa.int64())}),
                       target / f"part-{f:05d}.parquet")
    (target / "_SUCCESS").touch()
    return target


def etl_config(workdir: Path, raw: Path, size: int, storage: str, row_group: int, workers: int = 1):
    from pipeline.config import load

    feature = {"name": IMAGE, "type": "image", "height": size, "width": size, "channels": 3, "source": "bytes",
               "storage": storage}
    return load(str(REPO / "conf" / "base.yaml"), [
        f"workdir={workdir}", f"name=imagebench-{storage}", "data.source=parquet", f"data.path={raw}",
        "data.id_column=id", f"data.features=[{json.dumps(feature)}]", f"parallelism.data={workers}",
        f"shards.rows_per_row_group={row_group}", "tracking.log_model=false"])


def shard_bytes(manifest) -> int:
    return sum(os.path.getsize(p) for split in manifest.splits for p in manifest.files(split))


def encoded_row_groups(files: list[str], column: str) -> list[list[bytes]]:
    """The encoded bytes of every row group of `files`, as Python lists (what the loader decodes)."""
    import pyarrow.parquet as pq

    groups = []
    for path in files:
        pf = pq.ParquetFile(path)
        for g in range(pf.metadata.num_row_groups):
            groups.append(pf.read_row_group(g, columns=[column]).column(0).to_pylist())
    return groups


# -- measurements ------------------------------------------------------------------------------------
def bench_plain(groups: list[list[bytes]], size: int) -> float:
    """images/s of a plain loop: decode_images over the in-memory byte strings, one call per row group."""
    from udfs.transforms import decode_images

    started, count = time.perf_counter(), 0
    for data in groups:
        pixels, bad, _ = decode_images(data, size, size, 3)
        count += len(pixels)
    return count / (time.perf_counter() - started)


def make_loader(manifest, threads: int, batch: int, buffer: int, prefetch: int):
    from pipeline.data import StreamingLoader

    rows = manifest.split("train").rows
    return StreamingLoader(manifest.files("train", 0), steps_per_epoch=-(-rows // batch), seed=0, rank=0,
                           features=manifest.feature_set, row_group_rows=manifest.row_group_rows("train", 0),
                           shuffle_buffer_rows=buffer, reader_threads=threads, prefetch=prefetch)


def bench_loader(manifest, threads: int, batch: int, buffer: int, prefetch: int, epoch: int = 0) -> float:
    """images/s of one rank's StreamingLoader epoch over the shard set's train split."""
    loader = make_loader(manifest, threads, batch, buffer, prefetch)
    started, count = time.perf_counter(), 0
    for x, y in loader.epoch(epoch):
        count += len(x[IMAGE])
    return count / (time.perf_counter() - started)


def breakdown(manifest, batch: int, buffer: int, prefetch: int) -> dict[str, float]:
    """Microseconds per image of each part of the encoded loader (1 reader thread), each measured alone."""
    import pyarrow.parquet as pq

    import pipeline.data.arrow_read as arrow_read
    from udfs.transforms import decode_images

    spec = next(f for f in manifest.feature_set if f.name == IMAGE)
    files = manifest.files("train", 0)
    rows = manifest.split("train").rows
    read_s = list_s = decode_s = 0.0
    for path in files:
        pf = pq.ParquetFile(path)
        for g in range(pf.metadata.num_row_groups):
            t0 = time.perf_counter()
            table = pf.read_row_group(g, columns=[spec.column, "label"])
            t1 = time.perf_counter()
            data = table.column(spec.column).to_pylist()
            t2 = time.perf_counter()
            decode_images(data, spec.height, spec.width, spec.channels)
            t3 = time.perf_counter()
            read_s, list_s, decode_s = read_s + t1 - t0, list_s + t2 - t1, decode_s + t3 - t2
    # Everything after the reader: the same loader, read_row_group answering from memory (pre-decoded).
    cache = {}
    original = arrow_read.read_row_group
    for path in files:
        pf = pq.ParquetFile(path)
        for g in range(pf.metadata.num_row_groups):
            cache[(path, g)] = original(pf, path, g, "features", "label", None, manifest.feature_set)
    arrow_read.read_row_group = lambda _pf, path, index, *a, **k: cache[(path, index)]
    try:
        downstream_s = min(_timed_epoch(manifest, batch, buffer, prefetch) for _ in range(2))
        downstream_sync_s = _timed_epoch(manifest, batch, buffer, 0)
    finally:
        arrow_read.read_row_group = original
    full_s = _timed_epoch(manifest, batch, buffer, prefetch)
    full_sync_s = _timed_epoch(manifest, batch, buffer, 0)
    per = 1e6 / rows
    return {"parquet read": read_s * per, "to_pylist": list_s * per, "decode_images": decode_s * per,
            "downstream (buffer, batches, prefetch)": downstream_s * per,
            "downstream, prefetch=0": downstream_sync_s * per,
            "loader, 1 thread": full_s * per, "loader, 1 thread, prefetch=0": full_sync_s * per}


def decode_parts(groups: list[list[bytes]], size: int, limit: int = 4096) -> dict[str, float]:
    """Microseconds per image of decode_image's steps (first `limit` images): Image.open (header parse),
    load (the codec), and the rest (convert, resize check, asarray, CHW transpose, copy into the batch)."""
    from PIL import Image

    from udfs.transforms import decode_images

    data = [d for group in groups for d in group][:limit]
    started = time.perf_counter()
    for d in data:
        with Image.open(io.BytesIO(d)):
            pass
    opened = time.perf_counter() - started
    started = time.perf_counter()
    for d in data:
        with Image.open(io.BytesIO(d)) as image:
            image.load()
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    decode_images(data, size, size, 3)
    whole = time.perf_counter() - started
    per = 1e6 / len(data)
    return {"Image.open": opened * per, "load (codec)": (loaded - opened) * per,
            "convert + asarray + transpose + copy": (whole - loaded) * per}


def pixel_reads(manifest, repeat: int = 3) -> dict[str, float]:
    """Microseconds per image to read one decoded row group's pixels: as the shards store them (Parquet
    LIST of uint8, i.e. INT32 values with repetition levels) and, for comparison, the same pixels written
    to an in-memory Parquet file as fixed_size_binary(C*H*W) (snappy, like the shards)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.arrow_read import read_row_group

    spec = next(f for f in manifest.feature_set if f.name == IMAGE)
    path = manifest.files("train", 0)[0]
    pf = pq.ParquetFile(path)
    rows = pf.metadata.row_group(0).num_rows
    width = spec.channels * spec.height * spec.width

    def best(fn) -> float:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times) * 1e6 / rows

    stored = best(lambda: read_row_group(pf, path, 0, "features", "label", None, manifest.feature_set))
    pixels = read_row_group(pf, path, 0, "features", "label", None, manifest.feature_set)[0][IMAGE]
    column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), rows, [None, pa.py_buffer(pixels.tobytes())])
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({spec.column: column}), buffer, compression="snappy", store_schema=False)
    data = buffer.getvalue()

    def read_binary():
        chunk = pq.read_table(pa.BufferReader(data)).column(0).combine_chunks()
        np.frombuffer(chunk.buffers()[1], np.uint8, rows * width, chunk.offset * width).reshape(
            rows, spec.channels, spec.height, spec.width)

    return {"read_row_group, list<uint8> pixels (as stored)": stored,
            "same pixels as fixed_size_binary, read + view": best(read_binary)}


def _timed_epoch(manifest, batch: int, buffer: int, prefetch: int) -> float:
    loader = make_loader(manifest, 1, batch, buffer, prefetch)
    started = time.perf_counter()
    for _ in loader.epoch(0):
        pass
    return time.perf_counter() - started


def profile_plain(groups: list[list[bytes]], size: int, top: int = 14) -> str:
    import cProfile
    import pstats

    from udfs.transforms import decode_images

    profiler = cProfile.Profile()
    profiler.enable()
    for data in groups:
        decode_images(data, size, size, 3)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# -- main --------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=64, help="image height = width (RGB)")
    parser.add_argument("--format", choices=["jpeg", "png"], default="jpeg")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality")
    parser.add_argument("--workdir", default="/tmp/shardline-image-bench")
    parser.add_argument("--row-group", type=int, default=1024, help="shards.rows_per_row_group")
    parser.add_argument("--buffer", type=int, default=4096, help="shuffle_buffer_rows")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; best of each")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of the plain decode loop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    total_started = time.perf_counter()
    workdir = Path(args.workdir)

    started = time.perf_counter()
    raw = land_raw(workdir, args.images, args.size, args.format, args.quality)
    raw_bytes = sum(p.stat().st_size for p in raw.glob("*.parquet"))
    land_s = time.perf_counter() - started

    from pipeline.etl import run_etl
    from pipeline.session import get_or_create_spark

    configs = {s: etl_config(workdir, raw, args.size, s, args.row_group) for s in ("decoded", "encoded")}
    spark = get_or_create_spark(configs["decoded"].spark)
    run_etl(spark, configs["encoded"])  # warm-up: JIT, Python workers, PIL imports
    etl_s: dict[str, list[float]] = {"decoded": [], "encoded": []}
    manifests = {}
    for _ in range(max(1, min(args.repeat, 2))):
        for storage in ("decoded", "encoded"):
            started = time.perf_counter()
            manifests[storage] = run_etl(spark, configs[storage])
            etl_s[storage].append(time.perf_counter() - started)
    spark.stop()
    decoded, encoded = manifests["decoded"], manifests["encoded"]
    train_rows = encoded.split("train").rows
    spec = next(f for f in encoded.feature_set if f.name == IMAGE)
    groups = encoded_row_groups(encoded.files("train", 0), spec.column)

    bench_plain(groups, args.size)  # warm: page cache, PIL plugins
    for manifest in (encoded, decoded):  # warm: torch import, the shard files in the page cache
        bench_loader(manifest, 1, args.batch, args.buffer, args.prefetch)
    runs: dict[str, list[float]] = {"plain": [], "decoded": [], **{f"encoded{t}": [] for t in args.threads}}
    for r in range(max(1, args.repeat)):
        runs["plain"].append(bench_plain(groups, args.size))
        for t in args.threads:
            runs[f"encoded{t}"].append(bench_loader(encoded, t, args.batch, args.buffer, args.prefetch, r))
        runs["decoded"].append(bench_loader(decoded, 1, args.batch, args.buffer, args.prefetch, r))
    best = {k: max(v) for k, v in runs.items()}
    parts = breakdown(encoded, args.batch, args.buffer, args.prefetch)
    codec = decode_parts(groups, args.size)
    reads = pixel_reads(decoded)

    print()
    print(f"data: {args.images} RGB {args.size}x{args.size} {args.format.upper()} images, mean "
          f"{raw_bytes / args.images / 1024:.1f} KiB raw Parquet per image; train {train_rows} rows on 1 rank; "
          f"row group {args.row_group}, shuffle buffer {args.buffer}, batch {args.batch}, prefetch {args.prefetch}; "
          f"landing {land_s:.1f}s, not timed; host {os.cpu_count()} cpus")
    print()
    print(f"{'measurement':<28} | {'images/s':>10}")
    print(f"{'-' * 28}-|-{'-' * 10}")
    print(f"{'plain decode loop':<28} | {best['plain']:>10,.0f}")
    for t in args.threads:
        print(f"{f'loader encoded, {t} thread(s)':<28} | {best[f'encoded{t}']:>10,.0f}")
    print(f"{'loader decoded, 1 thread':<28} | {best['decoded']:>10,.0f}")
    print()
    for t in args.threads:
        target = "  (target >= 0.9)" if t == 1 else ""
        print(f"loader encoded {t} thread(s) / plain decode = {best[f'encoded{t}'] / best['plain']:.2f}{target}")
    print(f"decoded loader / encoded loader (1 thread) = {best['decoded'] / best[f'encoded{args.threads[0]}']:.2f}")
    d_bytes, e_bytes = shard_bytes(decoded), shard_bytes(encoded)
    print(f"shard bytes decoded / encoded = {d_bytes / e_bytes:.2f}  ({d_bytes / 2**20:.1f} MiB / "
          f"{e_bytes / 2**20:.1f} MiB)")
    d_etl, e_etl = min(etl_s["decoded"]), min(etl_s["encoded"])
    print(f"ETL wall decoded / encoded = {d_etl / e_etl:.2f}  ({d_etl:.1f}s / {e_etl:.1f}s)")
    print()
    print("encoded loader breakdown, microseconds per image (each part timed alone, 1 thread):")
    for name, value in parts.items():
        print(f"  {name:<40} {value:8.1f}")
    print(f"  {'plain decode loop (best of rounds)':<40} {1e6 / best['plain']:8.1f}")
    print("decode_image's steps, microseconds per image:")
    for name, value in codec.items():
        print(f"  {name:<40} {value:8.1f}")
    print("decoded storage: reading one row group's pixels, microseconds per image:")
    for name, value in reads.items():
        print(f"  {name:<48} {value:8.1f}")
    names = list(reads)
    print(f"pixel read list<uint8> / fixed_size_binary = {reads[names[0]] / reads[names[1]]:.1f}")
    if args.profile:
        print()
        print(profile_plain(groups, args.size))
    print(f"\ntotal runtime: {time.perf_counter() - total_started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
