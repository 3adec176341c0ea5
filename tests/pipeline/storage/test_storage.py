"""pipeline.storage against a real S3-compatible server (moto's, started by the tests): URL -> filesystem
from the environment chain, listings, deletes, Parquet read by row group; checkpoints on s3://."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import storage
from pipeline.checkpoints import CheckpointStore
from pipeline.errors import ConfigError

# Also on the LTS stack (pyarrow 14, whose S3 filesystem ignores AWS_ENDPOINT_URL: pipeline.storage passes it).
pytestmark = pytest.mark.lts


def test_local_paths_resolve_to_the_local_filesystem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = storage.resolve("rel/x")
    assert isinstance(fs, pafs.LocalFileSystem) and path == os.path.join(str(tmp_path), "rel", "x")
    assert storage.resolve(f"file://{tmp_path}/y")[1] == f"{tmp_path}/y"
    assert not storage.is_remote("rel/x") and not storage.is_remote("file:///x") and storage.is_remote("s3://b/k")
    assert storage.join("s3://b/k/", "m.json") == "s3://b/k/m.json"
    storage.write_bytes(tmp_path / "a" / "b.bin", b"local")
    assert storage.read_bytes(tmp_path / "a" / "b.bin") == b"local"


def test_an_unknown_scheme_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"no filesystem serves nosuchstore:// URLs"):
        storage.resolve("nosuchstore://bucket/x")


def test_s3_urls_reach_the_endpoint_and_credentials_of_the_environment(s3, monkeypatch):
    url = s3.url("unit", "a", "b.bin")
    storage.write_bytes(url, b"hello")  # endpoint from AWS_ENDPOINT_URL_S3, keys from AWS_* (never passed)
    fs, path = storage.resolve(url)
    assert isinstance(fs, pafs.S3FileSystem) and path == f"{s3.bucket}/unit/a/b.bin"
    assert storage.read_bytes(url) == b"hello" and storage.exists(url)
    assert storage.list_files(s3.url("unit")) == {path: 5}
    assert storage.list_dirs(s3.url("unit")) == ["a"]
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in repr(fs.__reduce__())  # what executors are sent
    storage.delete_dir(s3.url("unit"))
    assert not storage.exists(url) and storage.list_files(s3.url("unit")) == {}
    # The same URL with wrong credentials in the chain is refused by the server: they really are used.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint.replace("127.0.0.1", "localhost"))  # a new client
    with pytest.raises(OSError):
        storage.read_bytes(url)


def test_a_parquet_file_on_s3_is_read_one_row_group_at_a_time(s3):
    table = pa.table({"x": np.arange(4000, dtype=np.int64), "y": np.arange(4000, dtype=np.float32) / 7})
    url = s3.url("unit-parquet", "t.parquet")
    fs, path = storage.resolve(url)
    pq.write_table(table, path, filesystem=fs, row_group_size=1000)
    logged = len(s3.log.read_text().splitlines())
    parquet = storage.open_parquet(url)
    assert parquet.metadata.num_row_groups == 4
    assert parquet.read_row_group(2, columns=["x"]).column("x").to_pylist() == list(range(2000, 3000))
    # The server's request log: the footer and the one column chunk, each a ranged GET (206), never the object.
    gets = [line for line in s3.log.read_text().splitlines()[logged:] if '"GET /' in line and "t.parquet" in line]
    assert gets and all('" 206 ' in line for line in gets), gets


def test_checkpoints_on_s3_are_whole_pruned_and_digest_checked(s3):
    store = CheckpointStore(s3.url("unit-ckpt", "run"), keep=2)
    for step in (10, 20, 30):
        store.save({"step": step, "ps": {"params": torch.full((3,), float(step))}})
    assert [c.step for c in store.list()] == [20, 30]
    assert torch.equal(store.load(store.latest())["ps"]["params"], torch.full((3,), 30.0))
    keys = sorted(os.path.basename(k) for k in storage.list_files(s3.url("unit-ckpt", "run")))
    assert keys == ["ckpt-000000000020.pt", "ckpt-000000000020.pt.sha256", "ckpt-000000000030.pt",
                    "ckpt-000000000030.pt.sha256"]  # no temporary objects, digests beside their checkpoints
    # A second store (another process: the resumed driver) sees the same; a corrupted object is refused.
    again = CheckpointStore(s3.url("unit-ckpt", "run"), keep=2)
    storage.write_bytes(s3.url("unit-ckpt", "run", "ckpt-000000000030.pt"), b"garbage")
    with pytest.raises(ConfigError, match=r"does not match its digest"):
        again.load(again.latest())
