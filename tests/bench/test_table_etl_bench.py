"""bench/table_etl_bench.py's landing: the Parquet folder and the Delta / Iceberg table hold the same rows,
written once per spec. No ETL, no timing."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("table_etl_bench")


@pytest.mark.parametrize("source", ["delta", "iceberg"])
def test_the_table_and_the_parquet_folder_hold_the_same_rows(bench, tmp_path, source):
    pytest.importorskip("deltalake" if source == "delta" else "pyiceberg",
                        reason=f"the {source} extra is not installed")
    import pyarrow.parquet as pq

    from pipeline.tables.read import pin

    parquet, table = bench.land(tmp_path, 100, 3, 4, source)
    plain = pq.read_table(parquet).sort_by("id")
    cfg = bench.config(tmp_path / "work", "t", source, table, 3, tmp_path / f"{source}-100x3-4")
    pinned = pin(cfg.data)
    assert len(pinned.units) == 4 and plain.num_rows == 100 and plain.column("id").to_pylist() == list(range(100))
    stamp = (tmp_path / f"{source}-100x3-4" / "_DONE").stat().st_mtime_ns
    assert bench.land(tmp_path, 100, 3, 4, source) == (parquet, table)  # landed once per spec
    assert (tmp_path / f"{source}-100x3-4" / "_DONE").stat().st_mtime_ns == stamp
