"""Typed ETL of the clicks source (13 numeric + 26 categorical) vs the numeric-only ETL of the same rows.

    .venv/bin/python bench/categorical_etl_bench.py [--rows 5000000] [--variants numeric hash vocab]
        [--workdir /tmp/shardline-categorical-bench] [--c0-max-vocab 2000000] [--c0-min-count 1]
        [--big-vocab 1000000] [--zipf 1.1]

Not timed: the click log (`data.source: clicks`, conf/clicks.yaml with data.clicks.rows=--rows,
big_vocab, zipf) is generated and landed as raw Parquet once per spec, plus a 20,000-row one for the
warm-ups. Then each variant runs in its own fresh process (its own local[2] session, conf/base.yaml's
spark section: driver memory 4g), so no variant inherits another's grown JVM heap or Python workers:
an untimed warm-up ETL of the small log (JIT, Python workers, imports), then `run_etl` on the big one,
timed, while a thread samples the RSS of the process tree (this Python, the driver JVM, the Python
workers) every 0.2 s. Variants:

  numeric  data.features = n0..n12 as plain names (the classic packed path; rows with a null numeric
           value are dropped, ~12% of them);
  hash     conf/clicks.yaml as is: n0..n12 mean-imputed, c0 hashed (hash_buckets 262144), c1..c25
           learned vocabularies (min_count 5);
  vocab    the same, but c0 is a learned vocabulary too (max_vocab --c0-max-vocab, min_count
           --c0-min-count), the biggest vocabulary the fit aggregates and the pack step maps.

Prints per variant: wall s, CPU s of the process tree (steadier than wall on a shared machine), rows/s,
peak RSS of the tree (and its JVM / Python-worker / driver-Python parts, each at its own peak), the wall
and CPU time of each ETL stage (profile pass, or the typed fit's one-pass encode; vocabulary aggregation;
fit; pack + write; the rest; timed by wrapping the functions run_etl calls), c0's distinct train values and vocabulary size. Then, untimed
diagnostics after the ETL: the floor of any Python pass that Spark feeds (a no-op mapInArrow over the
variant's input columns: what the typed ETL's pass 1 avoids by reading the Parquet source with pyarrow,
pipeline/etl/direct_read.py) and its JVM-only part (the same columns decoded and summed in Spark SQL, no Arrow transfer),
and the per-row cost of the typed ETL's per-feature work (udfs/transforms through the pack's Transform,
the profile's value counts) on 200k raw rows in this process. Last, typed / numeric ratios of wall
time (target <= 2), CPU time and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("numeric", "hash", "vocab")
WARMUP_ROWS = 20_000


# -- configs -----------------------------------------------------------------------------------------
def variant_overrides(variant: str, numeric: int = 13, categorical: int = 26, c0_max_vocab: int = 2_000_000,
                      c0_min_count: int = 1) -> list[str]:
    """The data.features override of a variant (conf/clicks.yaml's list unless numeric/vocab change it)."""
    if variant == "numeric":
        return [f"data.features={json.dumps([f'n{i}' for i in range(numeric)])}"]
    if variant == "hash":
        return []
    if variant == "vocab":
        features = [{"name": f"n{i}", "type": "numeric", "impute": "mean"} for i in range(numeric)]
        features.append({"name": "c0", "type": "categorical", "min_count": c0_min_count, "max_vocab": c0_max_vocab})
        features += [{"name": f"c{j}", "type": "categorical", "min_count": 5} for j in range(1, categorical)]
        return [f"data.features={json.dumps(features)}"]
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def config(workdir: str, variant: str, rows: int, big_vocab: int, zipf: float, warm: bool = False,
           c0_max_vocab: int = 2_000_000, c0_min_count: int = 1):
    from pipeline.config import load

    name = f"catbench-{variant}" + ("-warm" if warm else "")
    return load(str(REPO / "conf" / "clicks.yaml"), [
        f"workdir={workdir}", f"name={name}", f"data.clicks.rows={rows}", f"data.clicks.big_vocab={big_vocab}",
        f"data.clicks.zipf={zipf}", "parallelism.data=2", "tracking.log_model=false",
        *variant_overrides(variant, c0_max_vocab=c0_max_vocab, c0_min_count=c0_min_count)])


# -- measuring ---------------------------------------------------------------------------------------
class TreeRSS:
    """Samples the RSS and CPU time of this process and all its descendants in a thread; keeps the peak of
    the RSS sum and of each part (JVM, Python workers, this process), each at its own peak, and the CPU
    seconds the tree spent since start (a process that exits counts up to its last sample). CPU seconds
    are what the work costs; wall time on a shared 2-core machine also carries other users' load."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak = {"total": 0, "jvm": 0, "workers": 0, "driver": 0}
        self.samples = 0
        self._base: dict[int, float] = {}
        self._cpu: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> dict[str, int]:
        import psutil

        me = psutil.Process()
        parts = {"jvm": 0, "workers": 0, "driver": 0}
        cpu = {}
        for process in [me, *me.children(recursive=True)]:
            try:
                with process.oneshot():
                    rss = process.memory_info().rss
                    name = process.name()
                    times = process.cpu_times()
            except psutil.Error:  # a worker that just exited
                continue
            parts["driver" if process.pid == me.pid else "jvm" if "java" in name else "workers"] += rss
            cpu[process.pid] = times.user + times.system
        parts["total"] = sum(parts.values())
        with self._lock:
            self._cpu.update(cpu)
            for key, value in parts.items():
                self.peak[key] = max(self.peak[key], value)
        return parts

    def cpu_seconds(self) -> float:
        """CPU seconds of the tree since start, sampled now."""
        self.sample()
        with self._lock:
            return sum(v - self._base.get(pid, 0.0) for pid, v in self._cpu.items())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeRSS":
        self.sample()
        self._base = dict(self._cpu)
        self.peak = dict.fromkeys(self.peak, 0)
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@contextmanager
def stage_timers(seconds: dict[str, float], cpu: dict[str, float], tree: "TreeRSS"):
    """Time run_etl's stages by wrapping the functions it calls (no pipeline code changes): seconds gets
    each stage's total; nested stages (the vocabulary aggregation inside the typed encode pass) are
    subtracted from their parent afterwards by `stages`."""
    import pipeline.etl.onepass as onepass
    import pipeline.etl.run as run
    import pipeline.etl.typed as typed
    import pipeline.etl.vocab as vocab
    import pipeline.shards.write as write

    patched = []

    def wrap(module, attr: str, stage: str) -> None:
        original = getattr(module, attr)

        def timed(*args, **kwargs):
            started, cpu_started = time.perf_counter(), tree.cpu_seconds()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started
                cpu[stage] = cpu.get(stage, 0.0) + tree.cpu_seconds() - cpu_started

        setattr(module, attr, timed)
        patched.append((module, attr, original))

    wrap(run, "profile", "profile pass")  # the classic path's profile (one mapInArrow + collect)
    wrap(run, "write_shards", "pack + write")  # the classic pack (module-level import in run.py)
    wrap(typed, "merge_profiles", "profile pass")  # typed with a frozen fit: profile mapInArrow + summaries
    wrap(typed, "encode_pass", "encode pass")  # typed, learned fit: pass 1 (profile + local ids + counts)
    wrap(onepass, "summed_counts", "vocab aggregation")  # called inside encode_pass, subtracted below
    wrap(vocab, "rank_counts", "vocab aggregation")
    wrap(typed, "fit_features", "fit (medians, specs)")
    wrap(write, "write_shards", "pack + write")  # typed: imported inside run_typed_etl at call time
    try:
        yield seconds
    finally:
        for module, attr, original in reversed(patched):
            setattr(module, attr, original)


def stages(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """Each stage's own share: nested stages subtracted from their parent, the remainder named."""
    out = dict(seconds)
    if "vocab aggregation" in out:
        parent = "encode pass" if "encode pass" in out else "profile pass"
        if parent in out:
            out[parent] -= out["vocab aggregation"]
    out["rest (read, split sizes, manifest)"] = wall - sum(out.values())
    return out


def floor_scan(spark, raw: str, columns: list[str]) -> float:
    """Seconds of one no-op mapInArrow pass over `columns` of the raw input: Parquet decode in the JVM,
    rows -> Arrow -> the Python workers, which only count rows. The floor of any Python-UDF pass."""
    def count(batches):
        import pyarrow as pa

        n = 0
        for batch in batches:
            n += batch.num_rows
        yield pa.RecordBatch.from_pylist([{"n": n}])

    started = time.perf_counter()
    spark.read.parquet(raw).select(*columns).mapInArrow(count, "n long").collect()
    return time.perf_counter() - started


def jvm_scan(spark, raw: str, columns: list[str]) -> float:
    """Seconds of one JVM-only pass decoding the same columns (sum of each string's length / each number):
    the Parquet decode without the rows -> Arrow -> Python transfer that floor_scan adds."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    df = spark.read.parquet(raw).select(*columns)
    sums = [F.sum(F.length(F.col(f.name)) if isinstance(f.dataType, StringType) else F.col(f.name)) for f in
            df.schema.fields]
    started = time.perf_counter()
    df.agg(*sums).collect()
    return time.perf_counter() - started


def transform_costs(raw: str, manifest, sample_rows: int = 200_000, batch_rows: int = 10_000) -> dict[str, float]:
    """Microseconds per row, in this process on one core, of the typed ETL's per-feature work on the first
    `sample_rows` raw rows in Spark's Arrow batch size: the pack step's udfs/transforms calls through the
    same Transform the pack builds (numeric block, c0, the other categoricals) and the profile's value
    counting (as_text + value_counts)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from udfs.transforms import Transform, as_text, categorical_ids, numeric_block

    specs = [dict(f) for f in manifest.features]
    transform = Transform(specs, manifest.vocabularies())  # large vocabularies indexed as the pack does
    numeric = [s for s in specs if s["type"] == "numeric"]
    categorical = [s for s in specs if s["type"] == "categorical"]
    batches, rows = [], 0
    for path in sorted(Path(raw).glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=[s["name"] for s in specs]):
            batches.append(batch)
            rows += batch.num_rows
            if rows >= sample_rows:
                break
        if rows >= sample_rows:
            break
    costs = {"pack: numeric block (13)": 0.0, "pack: c0": 0.0, "pack: c1..c25 (vocab ids)": 0.0,
             "profile: value counts, c0": 0.0, "profile: value counts, c1..c25": 0.0}
    for batch in batches:
        started = time.perf_counter()
        numeric_block({s["name"]: batch.column(s["name"]) for s in numeric}, numeric)
        costs["pack: numeric block (13)"] += time.perf_counter() - started
        for spec in categorical:
            column = batch.column(spec["name"])
            key = "c0" if spec["name"] == "c0" else "c1..c25 (vocab ids)"
            started = time.perf_counter()
            categorical_ids(column, spec, transform.vocabularies.get(spec["name"]))
            costs[f"pack: {key}"] += time.perf_counter() - started
            if spec.get("hash_buckets"):
                continue
            started = time.perf_counter()
            pc.value_counts(as_text(column).drop_null())
            costs["profile: value counts, " + ("c0" if spec["name"] == "c0" else "c1..c25")] += \
                time.perf_counter() - started
    return {name: value * 1e6 / rows for name, value in costs.items()}


def run_variant(args) -> dict:
    """One variant in this process: warm-up ETL on the small log, then the timed, sampled ETL."""
    from pipeline.etl import run_etl
    from pipeline.session import get_or_create_spark

    opts = dict(c0_max_vocab=args.c0_max_vocab, c0_min_count=args.c0_min_count)
    cfg = config(args.workdir, args.only, args.rows, args.big_vocab, args.zipf, **opts)
    warm = config(args.workdir, args.only, WARMUP_ROWS, args.big_vocab, args.zipf, warm=True, **opts)
    spark = get_or_create_spark(cfg.spark)
    run_etl(spark, warm)
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    with TreeRSS() as rss, stage_timers(seconds, cpu, rss):
        started, cpu_started = time.perf_counter(), rss.cpu_seconds()
        manifest = run_etl(spark, cfg)
        wall, cpu_s = time.perf_counter() - started, rss.cpu_seconds() - cpu_started
    from pipeline.etl.clicks import clicks_raw_path

    raw = str(clicks_raw_path(cfg.data, cfg.workdir).absolute())
    columns = ["id", *cfg.data.feature_names, "label"]
    with TreeRSS() as tree:
        floor = floor_scan(spark, raw, columns)
        floor_cpu = tree.cpu_seconds()
    with TreeRSS() as tree:
        jvm = jvm_scan(spark, raw, columns)
        jvm_cpu = tree.cpu_seconds()
    costs = transform_costs(raw, manifest) if args.only != "numeric" else {}
    c0 = next((f for f in manifest.feature_set if f.name == "c0"), None)
    report = manifest.etl_report or {}
    result = {"variant": args.only, "wall": wall, "cpu": cpu_s, "stages": stages(seconds, wall),
              "stages_cpu": stages(cpu, cpu_s), "peak": rss.peak, "floor_scan": floor, "floor_cpu": floor_cpu,
              "jvm_scan": jvm, "jvm_cpu": jvm_cpu,
              "costs": costs,
              "samples": rss.samples, "input_rows": report.get("input_rows"),
              "invalid_rows": report.get("invalid_rows"),
              "rows": sum(manifest.split(s).rows for s in manifest.splits),
              "c0": None if c0 is None else {"hash_buckets": c0.hash_buckets, "vocab_size": c0.vocab_size,
                                             "distinct": c0.distinct_values},
              "vocab_sizes": sum(f.vocab_size for f in manifest.feature_set if f.type == "categorical"),
              "shard_mib": sum(os.path.getsize(p) for s in manifest.splits for p in manifest.files(s)) / 2**20}
    spark.stop()
    return result


def land(args) -> dict:
    """Generate and land the big and the warm-up click logs (not measured)."""
    from pipeline.etl.clicks import generate_clicks
    from pipeline.session import get_or_create_spark

    cfg = config(args.workdir, "hash", args.rows, args.big_vocab, args.zipf)
    spark = get_or_create_spark(cfg.spark)
    started = time.perf_counter()
    generate_clicks(spark, config(args.workdir, "hash", WARMUP_ROWS, args.big_vocab, args.zipf).data, cfg.workdir)
    path = generate_clicks(spark, cfg.data, cfg.workdir)
    seconds = time.perf_counter() - started
    spark.stop()
    return {"path": str(path), "seconds": seconds,
            "mib": sum(p.stat().st_size for p in Path(path).glob("*.parquet")) / 2**20}


def _child(args, only: str) -> dict:
    cmd = [sys.executable, __file__, "--only", only, "--rows", str(args.rows), "--workdir", args.workdir,
           "--big-vocab", str(args.big_vocab), "--zipf", str(args.zipf), "--c0-max-vocab", str(args.c0_max_vocab),
           "--c0-min-count", str(args.c0_min_count)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"variant": only, "error": (out.stderr or out.stdout)[-3000:]}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--workdir", default="/tmp/shardline-categorical-bench")
    parser.add_argument("--big-vocab", type=int, default=1_000_000, help="data.clicks.big_vocab (c0's ids)")
    parser.add_argument("--zipf", type=float, default=1.1, help="data.clicks.zipf")
    parser.add_argument("--c0-max-vocab", type=int, default=2_000_000, help="vocab variant: c0's max_vocab")
    parser.add_argument("--c0-min-count", type=int, default=1, help="vocab variant: c0's min_count")
    parser.add_argument("--only", choices=("land",) + VARIANTS, help="one step in this process, as JSON")
    args = parser.parse_args()
    if args.only:
        import logging

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        print(json.dumps(land(args) if args.only == "land" else run_variant(args)))
        return 0
    total_started = time.perf_counter()
    landed = _child(args, "land")
    if "error" in landed:
        print(f"landing the click log failed:\n{landed['error']}", file=sys.stderr)
        return 1
    results = {v: _child(args, v) for v in args.variants}

    print()
    print(f"data: clicks, {args.rows:,} rows x (13 numeric + 26 categorical), c0 over {args.big_vocab:,} ids, "
          f"zipf {args.zipf}; raw Parquet {landed['mib']:.0f} MiB, landed in {landed['seconds']:.1f}s (not timed); "
          f"local[2], driver memory 4g, host {os.cpu_count()} cpus; each variant in a fresh process after a "
          f"{WARMUP_ROWS:,}-row warm-up ETL")
    print()
    print(f"{'variant':<8} | {'wall s':>7} | {'CPU s':>7} | {'rows/s':>9} | {'peak RSS MiB':>12} | {'JVM':>6} | {'py workers':>10} | "
          f"{'driver py':>9} | {'shards MiB':>10} | c0")
    print(f"{'-' * 8}-|-{'-' * 7}-|-{'-' * 7}-|-{'-' * 9}-|-{'-' * 12}-|-{'-' * 6}-|-{'-' * 10}-|-{'-' * 9}-|-{'-' * 10}-|---")
    mib = 2**20
    failed = False
    for v, r in results.items():
        if "error" in r:
            failed = True
            print(f"{v:<8} | error: {r['error'].strip().splitlines()[-1][:200]}")
            continue
        p = r["peak"]
        c0 = r["c0"]
        c0_text = "-" if c0 is None else (f"hash_buckets {c0['hash_buckets']}" if c0["hash_buckets"] else
                                          f"vocab {c0['vocab_size']:,} of {c0['distinct']:,} distinct")
        print(f"{v:<8} | {r['wall']:>7.1f} | {r['cpu']:>7.1f} | {args.rows / r['wall']:>9,.0f} | {p['total'] / mib:>12,.0f} | "
              f"{p['jvm'] / mib:>6,.0f} | {p['workers'] / mib:>10,.0f} | {p['driver'] / mib:>9,.0f} | "
              f"{r['shard_mib']:>10,.0f} | {c0_text}")
    print()
    for v, r in results.items():
        if "error" not in r:
            parts = "; ".join(f"{name} {s:.1f}s ({r['stages_cpu'].get(name, 0):.0f} CPU s)"
                              for name, s in r["stages"].items())
            print(f"  {v}: {parts}; {r['rows']:,} rows written of {r['input_rows']:,} "
                  f"({r['invalid_rows']:,} invalid dropped); {r['samples']} RSS samples")
    print()
    print("floor of a pass Spark feeds: one no-op mapInArrow over the variant's input columns (JVM Parquet decode "
          "-> Arrow -> Python workers; the typed pass 1 reads a Parquet source with pyarrow instead), seconds:")
    for v, r in results.items():
        if "error" not in r:
            print(f"  {v}: {r['floor_scan']:.1f}s, {r['floor_cpu']:.0f} CPU s ({r['floor_cpu'] / r['cpu']:.0%} of its "
                  f"ETL's CPU s); of which JVM-only decode of the same columns (sum of lengths/values, no Arrow): "
                  f"{r['jvm_scan']:.1f}s, {r['jvm_cpu']:.0f} CPU s")
    for v, r in results.items():
        if "error" not in r and r["costs"]:
            parts = "; ".join(f"{name} {us:.2f}" for name, us in r["costs"].items())
            print(f"  {v}, per-feature work in one process, microseconds per row: {parts} "
                  f"(x {args.rows:,} rows = {sum(r['costs'].values()) * args.rows / 1e6:.1f} core-s)")
    print()
    base = results.get("numeric")
    for v in ("hash", "vocab"):
        r = results.get(v)
        if base and r and "error" not in base and "error" not in r:
            print(f"{v} / numeric: wall time {r['wall'] / base['wall']:.2f}x (target <= 2), "
                  f"CPU time {r['cpu'] / base['cpu']:.2f}x, peak RSS {r['peak']['total'] / base['peak']['total']:.2f}x")
    print(f"\ntotal runtime: {time.perf_counter() - total_started:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
