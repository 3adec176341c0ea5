"""Pass 2 of the one-pass typed ETL (issue 15): pass 1's files (ids and numbers, no strings) -> shard rows.

Runs inside the shard writer's `mapInArrow` body (udfs/shard_writer.py) over a DataFrame of partition
ids, one per Spark partition. For partition p it reads pass 1's files of p (udfs/typed_encode.py), maps
each learned categorical's local ids to global ones with a numpy take on a per-partition table (the local
dictionary looked up by udfs/transforms.vocab_ids through the same Transform vocabularies as `shardline
score` and the served model, so the ids are Transform.apply's), runs Transform.apply for everything else
(numerics standardized/imputed, vectors, images, text), and deals the rows into shards as pass 1 counted
them (udfs/pack.ShardDealer, keyed by pass 1's partition id).
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from udfs.pack import LABEL, SHARD, SPLIT, ShardDealer, label_indexer
from udfs.transforms import NULL_ID, Transform, vocab_ids
from udfs.typed_encode import hashed, learned, read_arrow
from udfs.typed_pack import output_columns


def local_tables(dictionary: pa.Table, remap: pa.Table, transform: Transform,
                 specs: Sequence[dict]) -> dict[str, np.ndarray]:
    """Per learned categorical: int64 global id of each local id, from a partition's `.dict` (distinct
    values) and `.remap` (distinct value of each local id) files."""
    features = dictionary.column("feature").to_numpy()
    remap_features = remap.column("feature").to_numpy()
    tables = {}
    for i, spec in enumerate(specs):
        if learned(spec):
            values = dictionary.column("value").filter(pa.array(features == i)).combine_chunks()
            index = remap.column("index").filter(pa.array(remap_features == i)).to_numpy()
            ids = vocab_ids(values, transform.vocabularies[spec["name"]]) if len(values) else np.zeros(0, np.int64)
            tables[spec["name"]] = ids[index]
    return tables


def make_remap_fn(specs: Sequence[dict], vocabularies: Mapping[str, pa.Array], files: Mapping[int, tuple],
                  label: str, split_column: str, label_classes: Optional[Sequence[str]], numeric_labels: bool,
                  split_offsets, split_rows, num_shards) -> Callable[[Iterator[pa.RecordBatch]],
                                                                     Iterator[pa.RecordBatch]]:
    """`files`: pass 1's partition id -> (data, dict, remap file; each None when not written); input
    batches hold those partition ids in an `id` column."""
    specs = [dict(s) for s in specs]
    rest = [s for s in specs if not (learned(s) or hashed(s))]
    transform = Transform(rest, vocabularies)
    lookup = Transform([s for s in specs if learned(s)], vocabularies)
    dealer = ShardDealer(split_offsets, split_rows, num_shards)
    labels_of = label_indexer(label_classes, numeric_labels)
    files = {int(k): v for k, v in files.items()}

    def remap(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for partition in batch.column("id").to_pylist():
                data, dictionary, remap = files.get(int(partition), (None, None, None))
                seen: dict[str, int] = {}
                if data is not None:
                    tables = local_tables(read_arrow(dictionary), read_arrow(remap), lookup, specs) if remap else {}
                    with pa.OSFile(data, "rb") as source:
                        reader = pa.ipc.open_file(source)
                        for k in range(reader.num_record_batches):
                            yield _pack(reader.get_batch(k), specs, tables, transform, dealer, int(partition), seen,
                                        labels_of, label, split_column)
                dealer.check(int(partition), seen)

    return remap


def _pack(part: pa.RecordBatch, specs, tables, transform: Transform, dealer: ShardDealer, partition: int,
          seen: dict, labels_of, label: str, split_column: str) -> pa.RecordBatch:
    table = pa.Table.from_batches([part])
    arrays, valid, _, _ = transform.apply(table)
    if not valid.all():
        raise RuntimeError(f"internal: partition {partition} holds rows pass 1 found valid but the pack refuses; "
                           "please report this")
    for spec in specs:
        name = spec["name"]
        if learned(spec):
            local = table.column(name).to_numpy().astype(np.int64)
            ids = np.full(len(local), NULL_ID, dtype=np.int64)
            present = local >= 0
            ids[present] = tables.get(name, np.zeros(0, np.int64))[local[present]]
            arrays[name] = ids
        elif hashed(spec):
            arrays[name] = table.column(name).to_numpy().astype(np.int64)
    columns, names = output_columns(specs, arrays, table)
    splits = table.column(split_column).to_numpy(zero_copy_only=False)
    shard = dealer.deal(partition, splits, seen)
    return pa.RecordBatch.from_arrays(
        columns + [labels_of(table.column(label).combine_chunks()), pa.array(splits, pa.string()), pa.array(shard)],
        names=names + [LABEL, SPLIT, SHARD])
