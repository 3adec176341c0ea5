"""data.source delta | iceberg through the whole ETL on real tables: the pinned version's rows exactly, a
commit during the ETL not read, the version in the manifest, the shard set reused at the same version."""
import threading
import time

import pytest

deltalake = pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed: "
                                                    "the LTS stack's pyarrow 14 is too old for it")
pytestmark = pytest.mark.lts  # the LTS lane reports these as skipped, with the reason

from pipeline.config import build  # noqa: E402
from pipeline.errors import TableError  # noqa: E402
from pipeline.etl import run_etl  # noqa: E402
from tests.pipeline.tables.tables_data import data_config, iceberg_table, rows, shard_ids  # noqa: E402


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    """A Delta table of three commits: append 0..199, append 200..399, delete every id divisible by 7."""
    path = str(tmp_path_factory.mktemp("delta") / "events")
    deltalake.write_deltalake(path, rows(0, 200))
    deltalake.write_deltalake(path, rows(200, 200), mode="append")
    deltalake.DeltaTable(path).delete("id % 7 = 0")
    return path


def test_each_version_reads_exactly_its_rows(spark, tmp_path, events):
    at_1 = run_etl(spark, build(data_config(tmp_path / "v1", "delta", events, version=1)))
    assert shard_ids(at_1) == list(range(400))
    assert at_1.etl_report["table"]["version"] == 1 and at_1.etl_report["table"]["format"] == "delta"
    at_2 = run_etl(spark, build(data_config(tmp_path / "v2", "delta", events)))  # unpinned: the current one
    assert shard_ids(at_2) == [i for i in range(400) if i % 7]
    assert at_2.etl_report["table"]["version"] == 2
    at_0 = run_etl(spark, build(data_config(tmp_path / "v0", "delta", events, version=0)))
    assert shard_ids(at_0) == list(range(200))


def test_the_same_version_reuses_the_shard_set_and_another_makes_a_new_one(spark, tmp_path, events, caplog):
    cfg = build(data_config(tmp_path, "delta", events, version=1))
    first = run_etl(spark, cfg)
    with caplog.at_level("INFO", logger="pipeline.etl.run"):
        again = run_etl(spark, cfg)
    assert again.fingerprint == first.fingerprint
    assert "reused" in caplog.text and "version 1" in caplog.text
    changed = run_etl(spark, build(data_config(tmp_path, "delta", events, version=2)))
    assert changed.fingerprint != first.fingerprint and changed.etl_report["table"]["version"] == 2
    fewer = run_etl(spark, build(data_config(tmp_path, "delta", events, version=2, features=["f0"])))
    assert fewer.fingerprint != changed.fingerprint and fewer.feature_columns == ("f0",)


def test_a_table_recreated_at_the_same_path_is_not_taken_for_the_old_one(spark, tmp_path):
    import shutil

    path = str(tmp_path / "again")
    deltalake.write_deltalake(path, rows(0, 100))
    cfg = build(data_config(tmp_path / "work", "delta", path, version=0))
    first = run_etl(spark, cfg)
    shutil.rmtree(path)
    deltalake.write_deltalake(path, rows(1000, 100))  # version 0 again, other rows
    second = run_etl(spark, cfg)
    assert shard_ids(second) == list(range(1000, 1100)) and second.fingerprint != first.fingerprint


def test_a_commit_during_the_etl_is_not_read(spark, tmp_path):
    path = str(tmp_path / "growing")
    deltalake.write_deltalake(path, rows(0, 300))
    stop = threading.Event()
    appended = []

    def writer():  # appends as fast as it can while the ETL runs
        start = 1000
        while not stop.is_set():
            deltalake.write_deltalake(path, rows(start, 50), mode="append")
            appended.append(start)
            start += 50

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not appended:  # at least one commit after the table's first
            assert thread.is_alive() and time.monotonic() < deadline, "the writer thread made no commit in 60 s"
            stop.wait(0.01)
        manifest = run_etl(spark, build(data_config(tmp_path / "work", "delta", path)))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    version = manifest.etl_report["table"]["version"]
    assert deltalake.DeltaTable(path).version() > version  # the writer went on committing during the ETL
    expected = list(range(300)) + [i for s in appended[:version] for i in range(s, s + 50)]
    assert shard_ids(manifest) == sorted(expected)


def test_a_feature_missing_at_the_pinned_version_names_the_table_and_version(spark, tmp_path, events):
    with pytest.raises(TableError, match=r"column\(s\) \['f9'\] are not in Delta table .*events at version 1"):
        run_etl(spark, build(data_config(tmp_path, "delta", events, version=1, features=["f0", "f9"])))


def test_bad_pins_name_the_table_and_the_fix(spark, tmp_path, events):
    with pytest.raises(TableError, match=r"has no version 9 \(its versions are up to 2\); set data.version"):
        run_etl(spark, build(data_config(tmp_path, "delta", events, version=9)))
    with pytest.raises(TableError, match=r"has no version at data.timestamp=2001-01-01.*: its first commit is at"):
        run_etl(spark, build(data_config(tmp_path, "delta", events, timestamp="2001-01-01T00:00:00Z")))
    plain = tmp_path / "plain"
    plain.mkdir()
    rows(0, 10).to_pandas().to_parquet(plain / "part-0.parquet")
    with pytest.raises(TableError, match=r"is not a Delta table \(no _delta_log there\); it holds Parquet files"):
        run_etl(spark, build(data_config(tmp_path, "delta", str(plain))))
    assert not (tmp_path / "shards").exists()  # nothing was written


def test_iceberg_snapshots_read_exactly_their_rows(spark, tmp_path):
    pytest.importorskip("pyiceberg", reason="the iceberg extra (shardline[iceberg]) is not installed")
    catalog_cfg, catalog, table = iceberg_table(tmp_path, "ns.events", rows(0, 200), rows(200, 200))
    table.delete("id < 50")
    snapshots = [s.snapshot_id for s in catalog.load_table("ns.events").snapshots()]

    def etl(name, **pin):
        return run_etl(spark, build(data_config(tmp_path / name, "iceberg", "ns.events", iceberg=catalog_cfg, **pin)))

    assert shard_ids(etl("s1", snapshot_id=snapshots[1])) == list(range(400))
    current = etl("now")
    assert shard_ids(current) == list(range(50, 400))
    assert current.etl_report["table"]["version"] == snapshots[-1]
    assert current.etl_report["table"]["uri"] == "iceberg://test/ns.events"
    with pytest.raises(TableError, match=r"has no snapshot 12345 \(the newest are .*\); set data.snapshot_id"):
        etl("bad", snapshot_id=12345)
    with pytest.raises(TableError, match=r"Iceberg table 'ns.nope' is not in catalog 'test'"):
        run_etl(spark, build(data_config(tmp_path / "x", "iceberg", "ns.nope", iceberg=catalog_cfg)))
    with pytest.raises(TableError, match=r"Iceberg catalog 'elsewhere' cannot be loaded"):
        run_etl(spark, build(data_config(tmp_path / "y", "iceberg", "ns.events", iceberg={"name": "elsewhere"})))


def test_a_timestamp_pins_the_version_current_then(spark, tmp_path, events):
    from datetime import datetime, timezone

    history = {h["version"]: h["timestamp"] for h in deltalake.DeltaTable(events).history()}
    between = datetime.fromtimestamp((history[1] + 0.5) / 1000, tz=timezone.utc).isoformat()
    manifest = run_etl(spark, build(data_config(tmp_path, "delta", events, timestamp=between)))
    assert manifest.etl_report["table"]["version"] == 1
    assert shard_ids(manifest) == list(range(400))
