"""Shard sets on an object store (a real S3-compatible server, moto): files under a fresh per-ETL prefix,
the manifest published last; a reader sees the old set until the publish, then the new one, never a
half-written one; stale prefixes are collected after a publish, the previous one kept for its readers."""
from __future__ import annotations

import os

import pytest

from pipeline import storage
from pipeline.shards import load_manifest
from pipeline.shards.manifest import Manifest
from pipeline.shards.publish import PREFIX
from pipeline.shards.write import write_shards

SPLITS = ("train", "validation", "test")

# Also on the LTS stack (pyarrow 14, whose S3 filesystem ignores AWS_ENDPOINT_URL: pipeline.storage passes it).
pytestmark = pytest.mark.lts


def _pack(variant: float):
    """A tiny mapInArrow pack body: two features, a label, the split by id % 3, train dealt into 2 shards."""

    def pack(batches):
        import numpy as np
        import pyarrow as pa

        for batch in batches:
            ids = batch.column("id").to_numpy()
            values = np.column_stack([ids, ids * 2.0 + variant]).astype(np.float32).reshape(-1)
            yield pa.RecordBatch.from_arrays(
                [pa.FixedSizeListArray.from_arrays(pa.array(values), 2), pa.array(ids % 3, pa.int64()),
                 pa.array([SPLITS[i % 3] for i in ids]), pa.array((ids // 3) % 2 * (ids % 3 == 0), pa.int32())],
                names=["features", "label", "split", "shard"])

    return pack


def _write(spark, target: str, variant: float = 0.0) -> Manifest:
    return write_shards(spark.range(0, 60, numPartitions=2), _pack(variant), target,
                        num_shards={"train": 2, "validation": 1, "test": 1}, name="publish", task="classification",
                        feature_columns=["a", "b"], label_column="label", label_mapping=["0", "1", "2"],
                        standardized=False, means=[0.0, 0.0], stds=[1.0, 1.0], etl_report={},
                        rows_per_row_group=8, rows_per_file=1000)


def _prefixes(shards):
    return sorted(n for n in storage.list_dirs(shards) if n.startswith(PREFIX))


def _rows(manifest):
    return sum(storage.open_parquet(f).metadata.num_rows for f in manifest.files("train"))


def test_a_reader_sees_the_old_set_until_the_new_one_is_published(s3_spark, s3, monkeypatch):
    shards = s3.url("publish", "shards")
    first = _write(s3_spark, shards)
    assert first.data_prefix.startswith(PREFIX) and _prefixes(shards) == [first.data_prefix]
    assert all(f.startswith(f"{shards}/{first.data_prefix}/split=train/") for f in first.files("train"))
    loaded = load_manifest(shards)
    assert loaded.fingerprint == first.fingerprint and loaded.root == shards
    assert _rows(loaded) == loaded.split("train").rows == 20 and [s.rows for s in loaded.split("train").shards] == [10, 10]

    # A re-ETL killed after writing its files, before publishing (and before any cleanup could run).
    def killed(self, directory):
        raise KeyboardInterrupt("killed before the publish")

    monkeypatch.setattr(Manifest, "write", killed)
    monkeypatch.setattr(storage, "delete_dir", lambda url: None)
    with pytest.raises(KeyboardInterrupt):
        _write(s3_spark, shards, variant=1.0)
    monkeypatch.undo()
    half_written = [p for p in _prefixes(shards) if p != first.data_prefix]
    assert len(half_written) == 1 and storage.list_files(storage.join(shards, half_written[0]))
    during = load_manifest(shards)  # what a reader sees now: still the first set, whole
    assert during.data_prefix == first.data_prefix and _rows(during) == 20

    # A failed (not killed) re-ETL removes its own prefix.
    monkeypatch.setattr(Manifest, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        _write(s3_spark, shards, variant=1.0)
    monkeypatch.undo()
    assert len(_prefixes(shards)) == 2

    # A successful re-ETL publishes; the first set stays readable for a reader that loaded it just before.
    second = _write(s3_spark, shards, variant=1.0)
    assert second.fingerprint != first.fingerprint
    assert load_manifest(shards).data_prefix == second.data_prefix
    assert _prefixes(shards) == sorted([first.data_prefix, second.data_prefix])  # the killed one collected
    assert _rows(during) == 20
    # The next publish retires the first set; the same data gives the same fingerprint under any prefix.
    third = _write(s3_spark, shards)
    assert third.fingerprint == first.fingerprint
    assert _prefixes(shards) == sorted([second.data_prefix, third.data_prefix])
    with pytest.raises(OSError):
        storage.open_parquet(during.files("train")[0])


def test_a_local_shard_set_keeps_staging_and_rename(spark, tmp_path):
    manifest = _write(spark, str(tmp_path / "shards"))
    assert manifest.data_prefix == "" and load_manifest(tmp_path / "shards").fingerprint == manifest.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]  # no staging folder left beside it
    assert all(f.startswith(str(tmp_path / "shards" / "split=train")) for f in manifest.files("train"))


def test_a_typed_shard_set_on_s3_serves_its_vocabularies_and_batches(s3_spark, s3, tmp_path):
    from pipeline.data.stream import StreamingLoader
    from pipeline.etl import run_etl
    from pipeline.shards import rank_files, steps_per_epoch
    from tests.pipeline.typed_data import typed_config, write_typed_source

    conf_dir = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf")
    source = write_typed_source(tmp_path / "typed.parquet")
    cfg = typed_config(conf_dir, tmp_path, source, shards_dir=s3.url("typed", "shards"))
    written = run_etl(s3_spark, cfg)
    manifest = load_manifest(cfg.data.shards_dir)
    assert manifest.fingerprint == written.fingerprint and manifest.data_prefix
    assert manifest.vocabulary("city").to_pylist() == written.vocabulary("city").to_pylist() != []
    assert all(url.startswith(f"{cfg.data.shards_dir}/{manifest.data_prefix}/") for url in manifest.vocabulary_files().values())
    steps = steps_per_epoch(manifest, 2, cfg.train.batch_size)
    loader = StreamingLoader(rank_files(manifest, 0), steps_per_epoch=steps, seed=0, rank=0,
                             row_group_rows=manifest.row_group_rows("train", 0), features=manifest.feature_set)
    batches = list(loader.epoch(0))
    assert len(batches) == steps and sum(len(y) for _, y in batches) == manifest.split("train").shards[0].rows
    assert set(batches[0][0]) >= {"numeric", "city", "img", "title"}
    assert not (tmp_path / "work" / "shards").exists()
