"""`shardline score --output-format iceberg`: predictions appended to real Iceberg tables (pyiceberg's SQL catalog
on SQLite) as one snapshot per run, with the model's URI and version; the namespace and table created when
missing; a commit that lost a race retried (by pyiceberg, logged); an unknown catalog, a table of other columns
or a bad identifier refused with nothing written."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("pyiceberg", reason="the iceberg extra (shardline[iceberg]) is not installed: the LTS stack's "
                                        "pyarrow 14 is too old")
pytestmark = [pytest.mark.lts]

import pyarrow as pa  # noqa: E402

from pipeline.config.sources import IcebergConfig  # noqa: E402
from pipeline.errors import TableError  # noqa: E402
from pipeline.score import score  # noqa: E402
from pipeline.tables import iceberg_write  # noqa: E402
from pipeline.tables.catalog import iceberg_catalog  # noqa: E402
from tests.pipeline import test_score as typed  # noqa: E402

typed_run = typed.typed_run  # the module fixture: a tracked run of a small typed model, no training
SCORED = typed.TYPED_ROWS - len(typed.TYPED_BAD)  # rows a run writes (invalid rows dropped)
COLUMNS = ["key", "prediction", "probability", "model_uri", "model_version"]


def _catalog(tmp_path) -> IcebergConfig:
    return IcebergConfig(name="scores", catalog={"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                                 "warehouse": f"file://{tmp_path}/warehouse"})


def _cfg(typed_run, catalog: IcebergConfig, *extra):
    root, uri, *_ = typed_run
    properties = ", ".join(f"{k}: '{v}'" for k, v in catalog.catalog.items())
    return typed._typed_cfg(root, uri, "score.output_format=iceberg", f"data.iceberg.name={catalog.name}",
                      f"data.iceberg.catalog={{{properties}}}", *extra)


def _parquet_files(folder) -> set[str]:
    return {os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n.endswith(".parquet")}


def test_scores_append_as_one_snapshot_per_run_to_a_table_created_when_missing(spark, typed_run, tmp_path):
    run_uri = f"runs:/{typed_run[2]}"
    catalog = _catalog(tmp_path)
    first = score(spark, _cfg(typed_run, catalog), run_uri, str(typed_run[5]), "scores.typed")
    table = iceberg_catalog(catalog).load_table("scores.typed")  # namespace and table created by the run
    assert [s.snapshot_id for s in table.snapshots()] == [first.table_version]
    summary = table.current_snapshot().summary
    assert summary.operation.value == "append" and summary["added-records"] == str(SCORED)
    rows = table.scan().to_arrow()
    assert rows.column_names == COLUMNS and rows.num_rows == SCORED
    assert set(rows.column("model_uri").to_pylist()) == {run_uri}
    assert set(rows.column("model_version").to_pylist()) == {None}  # a run URI has no registered version

    second = score(spark, _cfg(typed_run, catalog), run_uri, str(typed_run[5]), "scores.typed")
    table.refresh()
    assert [s.snapshot_id for s in table.snapshots()] == [first.table_version, second.table_version]
    assert table.scan().to_arrow().num_rows == 2 * SCORED  # the first run's rows kept
    committed = {f.file.file_path.removeprefix("file://") for f in table.scan().plan_files()}
    assert _parquet_files(tmp_path / "warehouse" / "scores" / "typed" / "data") == committed


SCHEMA = pa.schema([("id", pa.int64()), ("model_uri", pa.string())])


def _ids(spark, start: int, count: int):
    return spark.range(start, start + count, numPartitions=2).selectExpr("id", "'m' AS model_uri")


def test_a_commit_that_lost_the_race_is_retried_and_logged(spark, tmp_path, caplog):
    """Both writers load the table before either commits. pyiceberg 0.12 retries the later commit itself (a
    refresh, the snapshot rebuilt on the new head, a backoff and a WARNING line); both snapshots land. Two runs
    that both found no table: the later one appends to the table the first created (logged here)."""
    catalog = _catalog(tmp_path)
    for existing in (True, False):
        identifier = f"ns.t_{existing}"
        if existing:
            iceberg_catalog(catalog).create_namespace_if_not_exists("ns")
            iceberg_catalog(catalog).create_table(identifier, schema=SCHEMA).append(
                pa.table({"id": [-1], "model_uri": ["seed"]}, schema=SCHEMA))
        a = iceberg_write.prepare(catalog, identifier, SCHEMA)
        b = iceberg_write.prepare(catalog, identifier, SCHEMA)
        files_a, files_b = iceberg_write.stage(_ids(spark, 0, 10), a), iceberg_write.stage(_ids(spark, 10, 7), b)
        caplog.clear()
        with caplog.at_level("WARNING"):
            iceberg_write.commit(a, files_a)
            iceberg_write.commit(b, files_b)
        messages = [r.getMessage() for r in caplog.records]
        expected = "Commit failed due to a concurrent update, retrying (1/4)" if existing else \
            "was created by a concurrent writer while this run scored"
        assert len([m for m in messages if expected in m]) == 1, messages
        table = iceberg_catalog(catalog).load_table(identifier)
        assert len(table.snapshots()) == (3 if existing else 2)
        assert sorted(table.scan().to_arrow().column("id").to_pylist()) == ([-1] if existing else []) + list(range(17))


def test_an_unknown_catalog_or_identifier_or_a_table_of_other_columns_is_refused(spark, typed_run, tmp_path):
    from pyspark.errors import PythonException

    run_uri = f"runs:/{typed_run[2]}"
    catalog = _catalog(tmp_path)
    bogus = IcebergConfig(name="nowhere", catalog={"type": "no-such-type"})
    with pytest.raises(TableError, match="Iceberg catalog 'nowhere' cannot be loaded"):
        score(spark, _cfg(typed_run, bogus), run_uri, str(typed_run[5]), "scores.typed")
    with pytest.raises(TableError, match=r"'typed' is not an Iceberg table identifier; .* namespace.table"):
        score(spark, _cfg(typed_run, catalog), run_uri, str(typed_run[5]), "typed")

    iceberg_catalog(catalog).create_namespace("scores")
    other = iceberg_catalog(catalog).create_table("scores.other", schema=pa.schema([("key", pa.string())]))
    with pytest.raises(TableError, match=r"Iceberg table scores.other cannot take these scores: .*Write to a new "
                                         r"table.*Nothing was written"):
        score(spark, _cfg(typed_run, catalog), run_uri, str(typed_run[5]), "scores.other")
    other.refresh()
    assert other.snapshots() == [] and not _parquet_files(tmp_path / "warehouse")

    def broken(batches):
        for batch in batches:
            raise RuntimeError("scoring failed")
            yield batch

    with pytest.raises(PythonException, match="scoring failed"):  # a failed run: no table, no files
        iceberg_write.append(_ids(spark, 0, 10).mapInArrow(broken, "id long, model_uri string"),
                             iceberg_write.prepare(catalog, "scores.failed", SCHEMA))
    assert not iceberg_catalog(catalog).table_exists("scores.failed") and not _parquet_files(tmp_path / "warehouse")
