"""`shardline score --output-format delta`: predictions appended to real Delta tables (written and read back by
deltalake) in one commit per run, with the model's URI and version; two concurrent runs both land, a stale
commit is retried with a log line, and a path that is not a Delta table (or a table of other columns) is
refused with nothing written."""
from __future__ import annotations

import collections
import os
import threading

import pytest

pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed: the LTS stack's "
                                        "pyarrow 14 is too old")
pytestmark = [pytest.mark.lts]

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from deltalake import DeltaTable, write_deltalake  # noqa: E402
from pyspark.errors import PythonException  # noqa: E402

from pipeline.errors import ShardlineError, TableError  # noqa: E402
from pipeline.score import score  # noqa: E402
from pipeline.tables import delta_write  # noqa: E402
from tests.pipeline import test_score as typed  # noqa: E402

typed_run = typed.typed_run  # the module fixture: a tracked run of a small typed model, no training
SCORED = typed.TYPED_ROWS - len(typed.TYPED_BAD)  # rows a run writes (invalid rows dropped)
COLUMNS = ["key", "prediction", "probability", "model_uri", "model_version"]
MODEL = "typed-delta"
JOIN_S = 300  # the most a concurrent score run's thread is waited for


@pytest.fixture(scope="module")
def registered(typed_run):
    """The typed run registered as version 1 of MODEL, alias champion: (run URI, version URI, alias URI)."""
    from mlflow import MlflowClient

    root, uri, run_id, *_ = typed_run
    client = MlflowClient(uri)
    client.create_registered_model(MODEL)
    version = client.create_model_version(MODEL, f"runs:/{run_id}/shardline", run_id=run_id)
    client.set_registered_model_alias(MODEL, "champion", version.version)
    return f"runs:/{run_id}", f"models:/{MODEL}/{version.version}", f"models:/{MODEL}@champion"


def _cfg(typed_run, *extra):
    root, uri, *_ = typed_run
    return typed._typed_cfg(root, uri, "score.output_format=delta", *extra)


def _rows(path) -> pa.Table:
    return DeltaTable(str(path)).to_pyarrow_table()


def _committed(path) -> set[str]:
    """The data files the table's current version names, relative to its folder."""
    return set(pa.table(DeltaTable(str(path)).get_add_actions(flatten=True)).column("path").to_pylist())


def _data_files(path) -> set[str]:
    """Every Parquet file under the table's folder (outside _delta_log), relative to it."""
    found = set()
    for folder, _, names in os.walk(path):
        found |= {os.path.relpath(os.path.join(folder, n), path) for n in names if n.endswith(".parquet")}
    return {f for f in found if not f.startswith("_delta_log")}


def test_scores_append_with_the_model_columns_and_a_second_run_keeps_the_first(spark, typed_run, registered,
                                                                                tmp_path):
    run_uri, version_uri, _ = registered
    table = tmp_path / "scores"
    first = score(spark, _cfg(typed_run), version_uri, str(typed_run[5]), str(table))
    assert (first.written_rows, first.table_version) == (SCORED, 0)  # the table is born holding the scores
    rows = _rows(table)
    assert rows.column_names == COLUMNS and rows.num_rows == SCORED
    assert set(rows.column("model_uri").to_pylist()) == {version_uri}
    assert set(rows.column("model_version").to_pylist()) == {"1"}

    second = score(spark, _cfg(typed_run), run_uri, str(typed_run[5]), str(table))
    assert second.table_version == 1
    dt = DeltaTable(str(table))
    assert dt.version() == 1 and [h["operation"] for h in dt.history()] == ["WRITE", "CREATE TABLE"]
    rows = _rows(table)
    assert rows.num_rows == 2 * SCORED
    by_model = collections.Counter(zip(rows.column("model_uri").to_pylist(), rows.column("model_version").to_pylist()))
    assert by_model == {(version_uri, "1"): SCORED, (run_uri, None): SCORED}  # a run URI has no registered version
    # Every data file in the folder is one a commit names: nothing uncommitted is left behind.
    assert _data_files(table) == _committed(table)
    assert all(f.startswith("score-") for f in _committed(table))


def test_two_concurrent_score_runs_both_land_with_no_row_lost_or_doubled(spark, typed_run, registered, tmp_path):
    run_uri, version_uri, alias_uri = registered
    table = str(tmp_path / "scores")
    score(spark, _cfg(typed_run), run_uri, str(typed_run[5]), table)  # version 0
    results, errors = {}, []

    def run(uri):
        try:
            results[uri] = score(spark, _cfg(typed_run), uri, str(typed_run[5]), table)
        except BaseException as exc:  # reported below: a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(uri,)) for uri in (version_uri, alias_uri)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_S)  # a hung run fails the test instead of hanging the suite
    assert [t for t in threads if t.is_alive()] == [], f"a score run did not finish within {JOIN_S} s"
    assert errors == []
    assert sorted(r.table_version for r in results.values()) == [1, 2]  # one commit each, both landed
    dt = DeltaTable(table)
    assert dt.version() == 2 and len(dt.history()) == 3
    rows = _rows(table)
    assert rows.num_rows == 3 * SCORED
    keys = sorted(set(rows.column("key").to_pylist()))
    assert len(keys) == SCORED
    got = collections.Counter(zip(rows.column("key").to_pylist(), rows.column("model_uri").to_pylist()))
    assert got == collections.Counter({(k, u): 1 for k in keys for u in (run_uri, version_uri, alias_uri)})
    assert _data_files(table) == _committed(table)


def _ids(spark, start: int, count: int):
    return spark.range(start, start + count, numPartitions=2).selectExpr("id", "'m' AS model_uri")


SCHEMA = pa.schema([("id", pa.int64()), ("model_uri", pa.string())])


def test_a_stale_commit_is_retried_after_the_other_writer_and_logged(spark, tmp_path, caplog):
    """Both writers read the table before either commits: the later commit conflicts (delta-rs's own retries
    are off), is logged and lands on the next version. Likewise two runs that both found no table."""
    for existing in (True, False):
        table = str(tmp_path / f"t-{existing}")
        if existing:
            write_deltalake(table, pa.table({"id": [-1], "model_uri": ["seed"]}, schema=SCHEMA))
        a, b = delta_write.prepare(table, SCHEMA), delta_write.prepare(table, SCHEMA)
        files_a, files_b = delta_write.stage(_ids(spark, 0, 10), a), delta_write.stage(_ids(spark, 10, 7), b)
        caplog.clear()
        with caplog.at_level("WARNING", logger="pipeline.tables.delta_write"):
            first = delta_write.commit(a, files_a)
            second = delta_write.commit(b, files_b)
        assert second == first + 1 == (2 if existing else 1)
        retries = [r.getMessage() for r in caplog.records if "conflicted with a concurrent writer" in r.getMessage()]
        assert len(retries) == 1 and "retry 1/7" in retries[0]
        ids = sorted(_rows(table).column("id").to_pylist())
        assert ids == ([-1] if existing else []) + list(range(17))


def test_a_commit_that_landed_with_its_answer_lost_is_not_committed_again(spark, tmp_path, caplog):
    """The run's commit lands but the run does not learn it (an object store's lost answer) and tries again from
    the version it read: the conflict's retry path finds the run's token in the history and returns that
    version; a second commit would name the same files again and double the rows."""
    table = str(tmp_path / "t")
    write_deltalake(table, pa.table({"id": [-1], "model_uri": ["seed"]}, schema=SCHEMA))
    target = delta_write.prepare(table, SCHEMA)
    files = delta_write.stage(_ids(spark, 0, 10), target)
    assert delta_write.commit(target, files) == 1
    target.table = DeltaTable(table, version=0)  # the run's view: its commit's answer never came back
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.tables.delta_write"):
        assert delta_write.commit(target, files) == 1  # the same token again: a real conflict at version 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("is in the table's history as version 1: not retried" in m for m in messages), messages
    assert not any("retry 1/7" in m for m in messages)
    dt = DeltaTable(table)
    assert dt.version() == 1 and len(dt.history()) == 2  # no second commit
    assert sorted(_rows(table).column("id").to_pylist()) == [-1] + list(range(10))  # no row doubled

    # A run whose commit did not land (another token, the same stale view) is retried and lands after it.
    other = delta_write.prepare(table, SCHEMA)
    other.table = DeltaTable(table, version=0)
    assert delta_write.commit(other, delta_write.stage(_ids(spark, 10, 3), other)) == 2
    assert sorted(_rows(table).column("id").to_pylist()) == [-1] + list(range(13))


def test_the_landed_check_searches_back_to_the_version_the_run_read_not_a_fixed_depth(spark, tmp_path):
    """Many writers' commits after the run's: its commit is still found (a fixed depth of 100 missed it, and the
    failure path would have deleted files the commit names), at its own version; none before `since`."""
    table = str(tmp_path / "t")
    write_deltalake(table, pa.table({"id": [-1], "model_uri": ["seed"]}, schema=SCHEMA))
    target = delta_write.prepare(table, SCHEMA)
    assert delta_write.commit(target, delta_write.stage(_ids(spark, 0, 4), target)) == 1
    assert target.read_version == 0
    for i in range(105):
        write_deltalake(table, pa.table({"id": [100 + i], "model_uri": ["other"]}, schema=SCHEMA), mode="append")
    assert DeltaTable(table).version() == 106
    assert delta_write.committed_version(table, target.token, target.read_version) == 1
    assert delta_write.committed_version(table, target.token) == 1  # the whole history
    assert delta_write.committed_version(table, target.token, 1) is None  # only commits after version 1
    assert delta_write.committed_version(table, "no-such-token", 0) is None


def test_a_failed_run_leaves_nothing(spark, tmp_path):
    def broken(batches):
        for batch in batches:
            raise RuntimeError("scoring failed")
            yield batch

    fresh = tmp_path / "fresh"
    with pytest.raises(PythonException, match="scoring failed"):
        delta_write.append(_ids(spark, 0, 10).mapInArrow(broken, "id long, model_uri string"),
                           delta_write.prepare(str(fresh), SCHEMA))
    assert not fresh.exists()  # no table, no folder: the run created both and removed both

    table = tmp_path / "existing"
    write_deltalake(str(table), pa.table({"id": [-1], "model_uri": ["seed"]}, schema=SCHEMA))
    with pytest.raises(PythonException, match="scoring failed"):
        delta_write.append(_ids(spark, 0, 10).mapInArrow(broken, "id long, model_uri string"),
                           delta_write.prepare(str(table), SCHEMA))
    assert DeltaTable(str(table)).version() == 0 and not [p for p in os.listdir(table) if p.startswith("score-")]


def test_a_parquet_folder_or_a_table_of_other_columns_is_refused_with_nothing_written(spark, typed_run, registered,
                                                                                    tmp_path):
    run_uri = registered[0]
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(pa.table({"key": [1, 2]}), plain / "part-0.parquet")
    with pytest.raises(TableError, match=r"plain exists and is not a Delta table \(no _delta_log/.*--output-format "
                                         r"parquet"):
        score(spark, _cfg(typed_run), run_uri, str(typed_run[5]), str(plain))
    assert os.listdir(plain) == ["part-0.parquet"]

    other = tmp_path / "other"
    write_deltalake(str(other), pa.table({"key": ["a"], "prediction": [1.5]}))
    with pytest.raises(TableError, match=r"other cannot take these scores: probability is missing in the table.*"
                                         r"key is string in the table, the scores' is long"):
        score(spark, _cfg(typed_run), run_uri, str(typed_run[5]), str(other))
    assert DeltaTable(str(other)).version() == 0 and _data_files(other) == _committed(other)

    with pytest.raises(ShardlineError, match="score.overwrite=true replaces a Parquet output"):
        score(spark, _cfg(typed_run, "score.overwrite=true"), run_uri, str(typed_run[5]), str(other))
