"""Shard sets on an object store (a real S3-compatible server, moto): files under a fresh per-ETL prefix,
the manifest published last; a reader sees the old set until the publish, then the new one, never a
half-written one; stale prefixes are collected after a publish, the previous one kept for its readers."""
from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from pipeline import storage
from pipeline.config import load
from pipeline.etl import run_etl
from pipeline.etl.digits import land_digits
from pipeline.shards import load_manifest
from pipeline.shards.manifest import Manifest
from pipeline.shards.publish import PREFIX


@pytest.fixture(scope="module")
def raw_on_s3(s3, tmp_path_factory):
    local = land_digits(tmp_path_factory.mktemp("digits") / "raw")
    url = s3.url("publish", "raw")
    fs, path = storage.resolve(url)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    return url


def _cfg(conf_dir, tmp_path, raw, shards, *extra):
    return load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", "data.source=parquet", f"data.path={raw}",
                                            f"data.shards_dir={shards}", *extra])


def _prefixes(shards):
    return [n for n in storage.list_dirs(shards) if n.startswith(PREFIX)]


def _rows(manifest):
    return sum(storage.open_parquet(f).metadata.num_rows for f in manifest.files("train"))


def test_a_reader_sees_the_old_set_until_the_new_one_is_published(s3_spark, s3, raw_on_s3, conf_dir, tmp_path,
                                                                    monkeypatch):
    spark = s3_spark
    shards = s3.url("publish", "shards")
    first = run_etl(spark, _cfg(conf_dir, tmp_path, raw_on_s3, shards))
    assert first.data_prefix.startswith(PREFIX) and _prefixes(shards) == [first.data_prefix]
    assert all(f.startswith(f"{shards}/{first.data_prefix}/split=train/") for f in first.files("train"))
    loaded = load_manifest(shards)
    assert loaded.fingerprint == first.fingerprint and loaded.root == shards and _rows(loaded) == first.split("train").rows

    # A re-ETL killed after writing its files, before publishing (no cleanup ran either).
    def killed(self, directory):
        raise KeyboardInterrupt("killed before the publish")

    monkeypatch.setattr(Manifest, "write", killed)
    monkeypatch.setattr(storage, "delete_dir", lambda url: None)
    with pytest.raises(KeyboardInterrupt):
        run_etl(spark, _cfg(conf_dir, tmp_path, raw_on_s3, shards, "data.split.seed=7"))
    monkeypatch.undo()
    half_written = [p for p in _prefixes(shards) if p != first.data_prefix]
    assert len(half_written) == 1 and storage.list_files(storage.join(shards, half_written[0]))
    during = load_manifest(shards)  # what a reader sees now: still the first set, whole
    assert during.data_prefix == first.data_prefix and _rows(during) == first.split("train").rows

    # A successful re-ETL publishes; the first set stays readable for a reader that loaded it just before.
    second = run_etl(spark, _cfg(conf_dir, tmp_path, raw_on_s3, shards, "data.split.seed=7"))
    assert second.fingerprint != first.fingerprint
    assert load_manifest(shards).data_prefix == second.data_prefix
    assert sorted(_prefixes(shards)) == sorted([first.data_prefix, second.data_prefix])  # killed one collected
    assert _rows(during) == first.split("train").rows
    # The next publish retires the first set.
    third = run_etl(spark, _cfg(conf_dir, tmp_path, raw_on_s3, shards))
    assert third.fingerprint == first.fingerprint  # the same data, whatever prefix it was written under
    assert sorted(_prefixes(shards)) == sorted([second.data_prefix, third.data_prefix])
    with pytest.raises(OSError):
        storage.open_parquet(during.files("train")[0])
