"""The typed ETL's one read of the source's strings (issue 15): pass 1 encodes, the driver fits, pass 2 packs.

Pass 1 (udfs/typed_encode.py, one mapInArrow over the source; a plain Parquet source's columns are read by
pyarrow in the tasks instead of through Spark's rows, pipeline/etl/direct_read.py) profiles every row, as the profile pass
does, and writes the valid rows to a scratch folder (Arrow IPC) beside the shard set with each learned categorical
as a partition-local int32 id, plus each partition's local dictionary with train counts. The driver sums
those counts (pyarrow, one table of all partitions' dictionaries) and ranks the vocabularies with
pipeline/etl/vocab.rank_counts (rule unchanged). Pass 2 (udfs/typed_remap.py) reads the scratch files,
ints and numbers only, maps local -> global ids and writes the shards (pipeline/shards/write.py). The
scratch folder is removed when the ETL ends, failed or not.

Measured (bench/categorical_etl_bench.py): see the commit message of this module's commit; the two-pass
design it replaces read the 26 string columns twice (JVM Parquet decode + Arrow transfer each time).
"""
from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config.workdir import hidden_sibling
from pipeline.etl.clean import MAX_CLASSES
from pipeline.etl.fit import counted_features, merge_summaries, raw_spec
from pipeline.etl.split import SPLIT_COLUMN

log = logging.getLogger(__name__)


def scratch_base(spark, shards: str | Path) -> str | Path:
    """Where pass 1's scratch goes: beside the shard set, which every executor can write. A shard set on
    an object store: the scratch files are written and read with plain file I/O by the tasks, so in local
    mode (one machine) they go to its temp folder; on a cluster that is refused with the way out."""
    from pipeline.storage import is_remote

    if not is_remote(shards):
        return shards
    import tempfile

    from pipeline.errors import ConfigError

    try:
        local_mode = spark.sparkContext.master.startswith("local")
    except Exception:  # Spark Connect: the cluster is elsewhere
        local_mode = False
    if not local_mode:
        raise ConfigError(f"data.shards_dir={shards} is on an object store, and typed features (data.features "
                          "with categorical, text, vector or image columns) need a shared local scratch folder for "
                          "their one-pass encoding, which object stores are not yet used for: write the shard set "
                          "to a path every executor can write (NFS, /dbfs) or use numeric features")
    return Path(tempfile.gettempdir()) / "shardline-encode" / Path(str(shards)).name


@contextmanager
def scratch_folder(shards: str | Path):
    """A hidden folder beside the shard set for pass 1's files, removed on exit (success or failure)."""
    root = hidden_sibling(Path(shards).absolute(), "encode")
    root.mkdir(parents=True)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summed_counts(paths: list[str]) -> pa.Table:
    """(feature, value, n) train counts of all partitions' dictionary files, one row per distinct pair
    seen in train rows."""
    from udfs.typed_encode import read_arrow

    if not paths:
        return pa.table({"feature": pa.array([], pa.int32()), "value": pa.array([], pa.string()),
                         "n": pa.array([], pa.int64())})
    table = pa.concat_tables([read_arrow(p) for p in paths])
    table = table.filter(pc.greater(table.column("n"), 0))
    summed = table.group_by(["feature", "value"]).aggregate([("n", "sum")])
    return pa.table({"feature": summed.column("feature"), "value": summed.column("value"),
                     "n": summed.column("n_sum")})


# Arrow batch rows of pass 1 when the session keeps Spark's default (10,000) and every feature is numeric or
# categorical (rows of ~40 short values, ~20 MB a batch): pass 1's per-batch work (a dictionary_encode
# and bincount per column, a hash per distinct value of a batch, the IPC write, the end-of-partition
# dedup of the per-batch dictionaries) costs 20-30% less CPU in 50,000-row batches (the clicks rows of
# bench/categorical_etl_bench.py through make_encode_fn in one process: 2.00 -> 1.57 CPU s for an 830k-row
# partition). The JVM's side of the pass (Parquet decode, rows -> Arrow) is the bulk and does not change.
# Image, vector and text rows keep the session's size (a batch of decoded images is held whole); so does
# a session that sets its own.
BATCH_KEY = "spark.sql.execution.arrow.maxRecordsPerBatch"
SPARK_DEFAULT_BATCH_ROWS = "10000"
WIDE_BATCH_ROWS = 50_000


@contextmanager
def batch_rows(spark, entries):
    """The session's Arrow batch size raised to WIDE_BATCH_ROWS for this pass (see above), then restored."""
    try:
        current = spark.conf.get(BATCH_KEY, SPARK_DEFAULT_BATCH_ROWS)
    except Exception:  # a Spark Connect session that refuses the read: keep its setting
        current = None
    if current != SPARK_DEFAULT_BATCH_ROWS or any(e.type not in ("numeric", "categorical") for e in entries):
        yield
        return
    spark.conf.set(BATCH_KEY, str(WIDE_BATCH_ROWS))
    try:
        yield
    finally:
        spark.conf.set(BATCH_KEY, current)


def encode_pass(df, entries, data, allowed, source_types: dict[str, str], root: Path, direct=None):
    """(Profiles with the vocabularies ranked, {pid: (data, dict, remap file)}) from one pass over `df`,
    or over `direct` (pipeline/etl/direct_read.DirectSource: the same rows read from Parquet by pyarrow)."""
    from udfs.parquet_rows import reading_named_rows
    from udfs.typed_encode import OUTPUT_DDL, make_encode_fn

    specs = [raw_spec(e, source_types) for e in entries]
    fn = make_encode_fn(specs, data.label, SPLIT_COLUMN, data.task == "regression",
                        data.task == "classification" and allowed is None, MAX_CLASSES, allowed, str(root))
    columns = [e.name for e in entries] + [data.label, SPLIT_COLUMN]
    if direct is not None:
        source, fn = direct.frame, reading_named_rows(direct.columns, SPLIT_COLUMN, fn)
    else:
        source = df.select(*[f"`{c}`" for c in columns])
    with batch_rows(df.sparkSession, entries):
        rows = source.mapInArrow(fn, OUTPUT_DDL).collect()
    summaries = sorted(((r["pid"], json.loads(r["summary"])) for r in rows), key=lambda x: x[0])
    files = {pid: (s.pop("data"), s.pop("dict"), s.pop("remap")) for pid, s in summaries}
    dict_rows = sum(s.pop("dict_rows", 0) for _, s in summaries)
    counted = counted_features(entries)
    limits = {i: (entries[i].min_count, entries[i].max_vocab) for i in counted}
    vocab, distinct = ranked(df.sparkSession, [d for _, d, _ in files.values() if d], limits, dict_rows)
    profiles = merge_summaries(summaries, entries, {entries[i].name: vocab[i] for i in counted},
                               {entries[i].name: distinct[i] for i in counted})
    return profiles, files


# The partitions' dictionaries (rows: one per distinct (feature, value) of a partition) are summed and ranked
# in the driver up to this many rows in all, in Spark above it (pipeline/etl/vocab.py). The bound is one of
# memory, not speed: the driver's sum was faster at every size measured (26 features, 8 partitions, local[2]:
# 4M rows 1.8 s in the driver, 50 s in Spark, which moves every row through its Arrow -> row conversion and
# two shuffles), and its peak grows ~120-160 bytes per row (+150 MB at 1M rows, +470 MB at 4M).
DRIVER_RANK_MAX_ROWS = 1_000_000


def ranked(spark, paths: list[str], limits: dict, dict_rows: int):
    """(vocabularies, distinct counts) of the counted features from the partitions' `.dict` files."""
    from pipeline.etl.vocab import rank_counts, rank_in_spark

    if not limits:
        return {}, {}
    if dict_rows <= DRIVER_RANK_MAX_ROWS:
        counts = summed_counts(paths)
        log.info("ranking %d distinct (feature, value) train counts in the driver (%.0f MiB of Arrow)",
                 counts.num_rows, counts.nbytes / 2**20)
        return rank_counts(counts, limits)
    log.info("ranking the vocabularies in Spark: the partitions' dictionaries hold %d rows (over %d, "
             "pipeline.etl.onepass.DRIVER_RANK_MAX_ROWS)", dict_rows, DRIVER_RANK_MAX_ROWS)
    return rank_in_spark(spark, paths, limits)
