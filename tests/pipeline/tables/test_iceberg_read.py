"""The Iceberg read on real tables (pyiceberg's SQL catalog on SQLite): columns by field id across a rename,
an empty table refused, the snapshot current at a time."""
import pytest

pytest.importorskip("pyiceberg", reason="the iceberg extra (shardline[iceberg]) is not installed: the LTS "
                                        "stack's pyarrow 14 is too old for it")
pytestmark = pytest.mark.lts

from pipeline.config import build  # noqa: E402
from pipeline.config.sources import IcebergConfig  # noqa: E402
from pipeline.errors import TableError  # noqa: E402
from pipeline.tables.catalog import iceberg_catalog  # noqa: E402
from pipeline.tables.read import pin, table_frame  # noqa: E402
from tests.pipeline.tables.tables_data import iceberg_catalog_config, rows  # noqa: E402


@pytest.fixture
def catalog(tmp_path):
    settings = iceberg_catalog_config(tmp_path)
    found = iceberg_catalog(IcebergConfig(**settings))
    found.create_namespace("ns")
    return found, settings


def _data(settings, identifier, **data):
    return build({"data": {"source": "iceberg", "path": identifier, "iceberg": settings, **data}}).data


def test_a_renamed_column_is_read_by_field_id_from_the_older_files(spark, catalog):
    found, settings = catalog
    table = found.create_table("ns.renamed", schema=rows(0, 1).schema)
    table.append(rows(0, 20))
    with table.update_schema() as update:
        update.rename_column("f1", "signal")
    table = found.load_table("ns.renamed")
    table.append(rows(20, 5).rename_columns(["id", "f0", "signal", "label"]))
    got = table_frame(spark, pin(_data(settings, "ns.renamed")), ["id", "signal"]).toPandas()
    assert sorted(got["id"]) == list(range(25)) and got["signal"].notna().all()
    expected = dict(zip(range(25), rows(0, 20).column("f1").to_pylist() + rows(20, 5).column("f1").to_pylist()))
    assert all(expected[i] == v for i, v in zip(got["id"], got["signal"]))


def test_a_table_with_no_snapshot_and_a_time_before_the_first_are_refused(catalog):
    found, settings = catalog
    table = found.create_table("ns.empty", schema=rows(0, 1).schema)
    with pytest.raises(TableError, match=r"Iceberg table ns.empty has no snapshot yet"):
        pin(_data(settings, "ns.empty"))
    table.append(rows(0, 3))
    with pytest.raises(TableError, match=r"has no snapshot at data.timestamp=2001-01-01.*its first snapshot is at"):
        pin(_data(settings, "ns.empty", timestamp="2001-01-01T00:00:00Z"))
