"""What a Delta or Iceberg table gained since a version, on real tables: only appended files, a non-append
commit (named), or nothing; a version that can no longer be read is a full re-read, not an error."""
import pytest

from pipeline.config import build
from pipeline.tables.changes import changes_since
from tests.pipeline.tables.tables_data import iceberg_table, rows

pytestmark = pytest.mark.lts


def _delta(path, **data):
    return build({"data": {"source": "delta", "path": str(path), **data}}).data


def test_delta_appends_deletes_and_no_change(tmp_path):
    deltalake = pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed")
    path = str(tmp_path / "t")
    deltalake.write_deltalake(path, rows(0, 10))
    first = changes_since(_delta(path), None)
    assert first.kind == "rewrite" and "first run" in first.reason and len(first.pinned.units) == 1
    assert changes_since(_delta(path), 0).kind == "none"
    deltalake.write_deltalake(path, rows(10, 5), mode="append")
    deltalake.write_deltalake(path, rows(15, 5), mode="append")
    appended = changes_since(_delta(path), 0)
    assert appended.kind == "append" and appended.pinned.version == 2 and len(appended.pinned.units) == 2
    assert "2 file(s) appended since version 0" in appended.reason
    deltalake.DeltaTable(path).alter.set_table_properties({"delta.appendOnly": "false"})  # no data file
    metadata_only = changes_since(_delta(path), 2)
    assert metadata_only.kind == "none" and "no rows appended since version 2" in metadata_only.reason
    deltalake.DeltaTable(path).delete("id = 3")
    deleted = changes_since(_delta(path), 2)
    assert deleted.kind == "rewrite" and "DELETE at 4" in deleted.reason and "not an append" in deleted.reason
    assert deleted.pinned.version == 4 and len(deleted.pinned.units) == 3  # the whole table


def test_a_deletion_vector_since_is_not_an_append(tmp_path):
    deltalake = pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed")
    from tests.pipeline.tables.delta_dv import add_deletion_vector

    path = str(tmp_path / "t")
    deltalake.write_deltalake(path, rows(0, 10))
    name = deltalake.DeltaTable(path).get_add_actions(flatten=True).column("path").to_pylist()[0]
    add_deletion_vector(path, name, [1])
    change = changes_since(_delta(path), 0)
    assert change.kind == "rewrite" and "1 data file(s) of version 0 were removed or changed" in change.reason


def test_iceberg_appends_and_overwrites(tmp_path):
    pytest.importorskip("pyiceberg", reason="the iceberg extra (shardline[iceberg]) is not installed")
    settings, catalog, table = iceberg_table(tmp_path, "ns.t", rows(0, 10))
    data = build({"data": {"source": "iceberg", "path": "ns.t", "iceberg": settings}}).data
    first = table.current_snapshot().snapshot_id
    table.append(rows(10, 5))
    appended = changes_since(data, first)
    assert appended.kind == "append" and len(appended.pinned.units) == 1
    assert appended.pinned.units[0].file.record_count == 5
    second = catalog.load_table("ns.t").current_snapshot().snapshot_id
    catalog.load_table("ns.t").overwrite(rows(100, 3))
    overwritten = changes_since(data, second)
    assert overwritten.kind == "rewrite" and "delete at" in overwritten.reason  # pyiceberg: delete + append
    assert changes_since(data, 12345).kind == "rewrite"  # a snapshot it no longer has: every row again
