"""`shardline workflow` on a Delta table's versions against a real `mlflow server`: the first run prepares
every row; a no-op rerun does nothing; an append prepares only the new rows (and, with train_on=new, trains
on them alone); a delete prepares everything again from a fresh fit, and says why."""
import pytest

deltalake = pytest.importorskip("deltalake", reason="the delta extra (shardline[delta]) is not installed: "
                                                    "the LTS stack's pyarrow 14 is too old for it")
pytestmark = pytest.mark.slow

from pipeline.config import build  # noqa: E402
from pipeline.config.workdir import Workdir  # noqa: E402
from pipeline.shards import load_manifest  # noqa: E402
from pipeline.workflow import WorkflowState, run_workflow  # noqa: E402
from tests.pipeline.tables.tables_data import rows, shard_ids  # noqa: E402


def test_the_workflow_follows_the_table_versions(spark, mlflow_server, tmp_path):
    table = str(tmp_path / "events")
    deltalake.write_deltalake(table, rows(0, 400))

    def config(**workflow):
        return build({"name": "nightly-delta", "workdir": str(tmp_path / "work"), "parallelism": {"data": 2},
                      "data": {"source": "delta", "path": table, "id_column": "id", "features": ["f0", "f1"],
                               "standardize": False},
                      "model": {"hidden": [8]}, "train": {"epochs": 2, "batch_size": 16},
                      "tracking": {"uri": mlflow_server, "experiment": "nightly-delta",
                                   "registered_model": "nightly-delta"},
                      "workflow": {"margin": 0.0, **workflow}})

    cfg = config()
    state = Workdir.of(cfg).workflow_state
    first = run_workflow(spark, cfg)
    assert first.did_work and first.processed == ["0"] and "first run" in first.reason
    assert first.promotion.alias == "champion"

    again = run_workflow(spark, cfg)
    assert not again.did_work and "nothing to do" in again.reason and "version 0" in again.reason

    deltalake.write_deltalake(table, rows(400, 200), mode="append")
    appended = run_workflow(spark, config(train_on="new", margin=1.0))
    assert appended.did_work and appended.processed == ["1"] and "appended since version 0" in appended.reason
    part = load_manifest(WorkflowState.load(state).partitions["1"]["shards"])
    assert shard_ids(part) == list(range(400, 600))  # only the new rows were prepared
    trained = load_manifest(Workdir.of(cfg).shards)  # what the model trained on: the new partition alone
    assert trained.etl_report["parts"] == [part.root] and trained.etl_report["table"]["version"] == 1
    assert appended.promotion.alias == "challenger"  # margin 1.0 cannot be beaten

    deltalake.DeltaTable(table).delete("id < 100")
    rewritten = run_workflow(spark, cfg)
    assert rewritten.did_work and "not an append" in rewritten.reason and "DELETE at 2" in rewritten.reason
    state_now = WorkflowState.load(state)
    assert list(state_now.partitions) == ["2"] and state_now.table["version"] == 2
    assert shard_ids(load_manifest(state_now.partitions["2"]["shards"])) == list(range(100, 600))
    merged = load_manifest(Workdir.of(cfg).shards)
    assert sum(s.rows for s in merged.splits.values()) == 500
