"""The Delta read on real tables: deletion vectors and column mapping applied, typed partition columns,
an unhonoured reader feature refused (delta-rs's own readers get two of these wrong or refuse them)."""
import json

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed: "
                                                    "the LTS stack's pyarrow 14 is too old for it")
pytestmark = pytest.mark.lts

from pipeline.config import build  # noqa: E402
from pipeline.errors import TableError  # noqa: E402
from pipeline.tables.read import pin, table_frame  # noqa: E402
from tests.pipeline.tables.delta_dv import add_deletion_vector  # noqa: E402
from tests.pipeline.tables.tables_data import rows  # noqa: E402


def _data(path, **data):
    return build({"data": {"source": "delta", "path": str(path), **data}}).data


def _ids(spark, pinned, columns=("id",)):
    return sorted(r["id"] for r in table_frame(spark, pinned, list(columns)).collect())


def test_deletion_vectors_drop_their_rows_and_earlier_versions_keep_them(spark, tmp_path):
    path = tmp_path / "dv"
    deltalake.write_deltalake(str(path), rows(0, 10))
    deltalake.write_deltalake(str(path), rows(10, 10), mode="append")
    table = deltalake.DeltaTable(str(path))
    by_rows = {a["path"]: a["num_records"] for a in pa.table(table.get_add_actions(flatten=True)).to_pylist()}
    name = sorted(by_rows)[0]
    version = add_deletion_vector(str(path), name, [0, 3, 9])
    pinned = pin(_data(path))
    assert pinned.version == version and "deletion vectors (3 rows in 1 files)" in pinned.honoured
    ids = _ids(spark, pinned)
    assert len(ids) == 20 - 3 and sum(by_rows.values()) == 20
    # The three rows are gone from the file that had them; QueryBuilder (delta-rs's DV-aware reader) agrees.
    from deltalake import QueryBuilder

    expected = sorted(QueryBuilder().register("t", deltalake.DeltaTable(str(path))).execute(
        "select id from t").read_all().column("id").to_pylist())
    assert ids == expected
    assert _ids(spark, pin(_data(path, version=version - 1))) == list(range(20))  # before the DV


@pytest.mark.parametrize("mode", ["name", "id"])
def test_column_mapping_reads_the_logical_columns(spark, tmp_path, mode):
    path = tmp_path / "mapped"
    deltalake.write_deltalake(str(path), rows(0, 12), configuration={"delta.columnMapping.mode": mode})
    pinned = pin(_data(path))
    assert f"column mapping ({mode})" in pinned.honoured
    # delta-rs 1.6.6's own to_pyarrow_table reads the physical columns as nulls; this read must not.
    got = table_frame(spark, pinned, ["id", "f0", "label"]).toPandas().sort_values("id")
    assert got["id"].tolist() == list(range(12)) and got["f0"].tolist() == [float(i) for i in range(12)]
    assert got["label"].notna().all()


def test_partition_columns_are_typed_and_can_be_features(spark, tmp_path):
    path = tmp_path / "parted"
    table = rows(0, 30).append_column("day", pa.array([i % 3 for i in range(30)], pa.int32()))
    deltalake.write_deltalake(str(path), table, partition_by=["day"])
    pinned = pin(_data(path))
    frame = table_frame(spark, pinned, ["id", "day"])
    assert dict(frame.dtypes)["day"] == "int"
    assert sorted((r["id"], r["day"]) for r in frame.collect()) == [(i, i % 3) for i in range(30)]


def test_a_reader_feature_it_does_not_honour_is_refused_naming_it(tmp_path):
    path = tmp_path / "future"
    deltalake.write_deltalake(str(path), rows(0, 5))
    protocol = {"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["variantType"],
                             "writerFeatures": ["variantType"]}}
    (path / "_delta_log" / f"{1:020d}.json").write_text(json.dumps(protocol) + "\n")
    with pytest.raises(TableError, match=r"needs reader feature\(s\) \['variantType'\], which shardline's Delta "
                                         r"read does not honour"):
        pin(_data(path))


def test_a_deletion_vector_in_a_partition_folder_with_an_encoded_name_is_found(spark, tmp_path):
    path = tmp_path / "spaced"
    table = rows(0, 12).append_column("p", pa.array(["x y" if i % 2 else "z" for i in range(12)]))
    deltalake.write_deltalake(str(path), table, partition_by=["p"])
    actions = pa.table(deltalake.DeltaTable(str(path)).get_add_actions(flatten=True)).to_pylist()
    spaced = next(a["path"] for a in actions if a["partition.p"] == "x y")  # logged as p=x%2520y/...
    add_deletion_vector(str(path), spaced, [0])  # the file's first row: id 1
    got = sorted((r["id"], r["p"]) for r in table_frame(spark, pin(_data(path)), ["id", "p"]).collect())
    assert got == [(i, "x y" if i % 2 else "z") for i in range(12) if i != 1]


def test_a_column_added_later_reads_as_null_from_the_older_files_and_a_root_with_a_space_is_read(spark, tmp_path):
    path = tmp_path / "a b" / "grown"  # delta-rs's file_uris() would name it a%20b: a folder that does not exist
    deltalake.write_deltalake(str(path), rows(0, 4))
    wider = rows(4, 3).append_column("extra", pa.array([1.5, 2.5, 3.5]))
    deltalake.write_deltalake(str(path), wider, mode="append", schema_mode="merge")
    got = sorted((r["id"], r["extra"]) for r in table_frame(spark, pin(_data(path)), ["id", "extra"]).collect())
    assert got == [(0, None), (1, None), (2, None), (3, None), (4, 1.5), (5, 2.5), (6, 3.5)]
