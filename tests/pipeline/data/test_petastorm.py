"""The petastorm backend reads the same rows as the arrow backend (LTS lane), or fails clearly (modern)."""
import importlib.util

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.data import StreamingLoader
from pipeline.errors import DataError

from .test_stream import _rank_files

pytestmark = pytest.mark.lts
HAS_PETASTORM = importlib.util.find_spec("petastorm") is not None and int(pa.__version__.split(".")[0]) <= 14


@pytest.mark.skipif(not HAS_PETASTORM, reason="petastorm runs on the LTS stack only (make test-lts)")
@pytest.mark.parametrize("shuffle", [True, False])
def test_petastorm_gives_the_same_rows_as_arrow(tmp_path, shuffle):
    rows = [301, 300, 302]
    files, total = _rank_files(tmp_path, rows)
    steps = -(-min(rows) // 32)
    seen = []
    for rank, rank_files in enumerate(files):
        got = {}
        for reader in ("arrow", "petastorm"):
            loader = StreamingLoader(rank_files, steps_per_epoch=steps, seed=1, rank=rank, reader=reader,
                                     shuffle=shuffle, shuffle_buffer_rows=64, reader_threads=2)
            batches = [(x["numeric"], y) for x, y in loader.epoch(0)]
            assert len(batches) == steps
            for x, y in batches:
                assert x.dtype == torch.float32 and torch.equal(x[:, 0], y.float())
            got[reader] = torch.cat([y for _, y in batches]).tolist()
        assert sorted(got["petastorm"]) == sorted(got["arrow"])  # same rows, each exactly once
        seen += got["petastorm"]
    assert sorted(seen) == list(range(total))


@pytest.mark.skipif(not HAS_PETASTORM, reason="petastorm runs on the LTS stack only (make test-lts)")
def test_petastorm_cur_shard_split_covers_every_row_once(tmp_path):
    from pipeline.data.petastorm_source import petastorm_chunks

    files, total = _rank_files(tmp_path, [200, 200], row_group_size=25)
    everything = [f for rank_files in files for f in rank_files]
    seen = []
    for shard in range(3):
        for _, labels in petastorm_chunks(everything, "features", "label", 4, seed=0, rank=0, epoch=0,
                                          shuffle=True, shard=(shard, 3)):
            seen += labels.tolist()
    assert sorted(seen) == list(range(total))


@pytest.mark.skipif(HAS_PETASTORM, reason="the modern stack has no petastorm")
def test_petastorm_missing_or_incompatible_is_a_clear_error(tmp_path):
    files, _ = _rank_files(tmp_path, [100])
    with pytest.raises(DataError, match=r"data.reader=petastorm.*constraints/lts.txt.*data.reader=arrow"):
        StreamingLoader(files[0], steps_per_epoch=2, seed=0, rank=0, reader="petastorm")


@pytest.mark.skipif(not HAS_PETASTORM, reason="petastorm runs on the LTS stack only (make test-lts)")
def test_petastorm_reads_the_shards_the_etl_wrote(spark, tmp_path):
    from pipeline.config import build
    from pipeline.etl import run_etl
    from pipeline.shards import rank_files, steps_per_epoch

    cfg = build({"name": "pst", "workdir": str(tmp_path), "parallelism": {"data": 2}, "data": {"source": "digits"}})
    manifest = run_etl(spark, cfg)
    steps = steps_per_epoch(manifest, 2, 32)
    for rank in range(2):
        got = {}
        for reader in ("arrow", "petastorm"):
            loader = StreamingLoader(rank_files(manifest, rank), steps_per_epoch=steps, seed=3, rank=rank,
                                     reader=reader, num_features=manifest.num_features)
            batches = [(x["numeric"], y) for x, y in loader.epoch(0)]
            assert len(batches) == steps
            rows = torch.cat([torch.cat([x, y.float().unsqueeze(1)], dim=1) for x, y in batches])
            got[reader] = sorted(map(tuple, rows.tolist()))
        assert len(got["arrow"]) == manifest.split("train").shards[rank].rows
        assert got["petastorm"] == got["arrow"]
