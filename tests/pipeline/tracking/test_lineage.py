"""`shardline run` on a Delta table: the MLflow run's inputs carry the table, its version, the rows and the
shard set's fingerprint; the registered model version names that run; the command prints what it trained on; a second run at the same version reuses
the shard set (same fingerprint), a run at another version does not."""
import pytest

deltalake = pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed: "
                                                    "the LTS stack's pyarrow 14 is too old for it")
pytestmark = [pytest.mark.slow, pytest.mark.lts]

from pipeline.cli import main  # noqa: E402
from tests.pipeline.tables.tables_data import rows  # noqa: E402


def _run(tmp_path, table, capsys, *overrides):
    work = tmp_path / "work"
    code = main(["run", "--config", "conf/digits.yaml", f"workdir={work}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                 "data.source=delta", f"data.path={table}", "data.id_column=id", "data.features=[f0,f1]",
                 "data.classes=null", "parallelism.data=2", "train.epochs=1", "train.batch_size=16",
                 "model.hidden=[8]", "tracking.registered_model=null", *overrides])
    out = capsys.readouterr().out
    assert code == 0, out
    return out, work


def _inputs(work, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    return client.get_run(run_id).inputs.dataset_inputs


def _run_id(out):
    return next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("mlflow run id: "))


def test_the_run_records_the_table_version_and_reuses_its_shards(tmp_path, capsys):
    table = str(tmp_path / "events")
    deltalake.write_deltalake(table, rows(0, 300))
    deltalake.write_deltalake(table, rows(300, 300), mode="append")

    out, work = _run(tmp_path, table, capsys, "data.version=0", "tracking.registered_model=events-model")
    line = next(x for x in out.splitlines() if x.startswith("trained on: "))
    assert f"Delta table {table} at version 0, 300 rows (shard set sha256:" in line
    fingerprint = line.rsplit("shard set ", 1)[1].rstrip(")")
    inputs = {i.dataset.name: i for i in _inputs(work, _run_id(out))}
    source = inputs[f"{table}@0"]
    tags = {t.key: t.value for t in source.tags}
    assert source.dataset.source_type == "delta_table" and '"delta_table_version": 0' in source.dataset.source
    assert tags["version"] == "0" and tags["rows"] == "300" and tags["fingerprint"] == fingerprint
    assert tags["format"] == "delta" and tags["mlflow.data.context"] == "training"
    from mlflow.tracking import MlflowClient  # the registered version names the run, and so the data

    (version,) = MlflowClient(f"sqlite:///{work}/mlflow.db").search_model_versions("name='events-model'")
    assert version.run_id == _run_id(out)

    manifest = work / "shards" / "digits" / "manifest.json"
    written = manifest.stat().st_mtime_ns
    again, _ = _run(tmp_path, table, capsys, "data.version=0")
    assert fingerprint in again and manifest.stat().st_mtime_ns == written  # the same shard set, not rewritten
    newer, _ = _run(tmp_path, table, capsys)  # unpinned: version 1, a new shard set
    assert "at version 1, 600 rows" in newer and fingerprint not in newer
