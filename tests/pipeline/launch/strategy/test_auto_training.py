"""train.backend=auto end to end on local Spark: the probes run, the pick trains, MLflow holds the pick and
the table, and a second launch of the same config reuses the cached probes."""
import json

import pytest

from pipeline import steps
from pipeline.config import load


@pytest.fixture(scope="module")
def auto_run(spark, tmp_path_factory, conf_dir):
    work = tmp_path_factory.mktemp("auto")
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={work}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                                           "train.backend=auto", "ps.placement=auto", "train.epochs=2",
                                           "tracking.log_model=false", "tracking.system_metrics_interval_s=null"])
    return cfg, steps.run_all(spark, cfg)


@pytest.mark.slow
def test_the_pick_trains_and_mlflow_records_it_with_the_table(auto_run, tmp_path):
    from mlflow import MlflowClient

    cfg, outcome = auto_run
    assert outcome.test_metrics["accuracy"] > 0.8
    client = MlflowClient(outcome.tracking_uri)
    run = client.get_run(outcome.run_id)
    pick = run.data.params["strategy.pick"]
    assert pick in ("allreduce", "ps driver sync", "ps hosts sync")  # exact sync only: no train.auto.allow
    assert run.data.tags["shardline.strategy"] == pick
    assert float(run.data.params["strategy.predicted_step_ms"]) > 0
    # the params say what ran, not "auto"
    assert run.data.params["train.backend"] == pick.split()[0]
    assert run.data.params["ps.placement"] == ("driver" if pick == "allreduce" else pick.split()[1])
    table = open(client.download_artifacts(outcome.run_id, "strategy/candidates.md", str(tmp_path))).read()
    for name in ("allreduce", "ps driver sync", "ps hosts sync"):
        assert f"| {name}" in table
    assert f"| {pick} **(pick)** |" in table
    record = json.load(open(client.download_artifacts(outcome.run_id, "strategy/candidates.json", str(tmp_path))))
    assert record["pick"] == pick and record["probes"]["ranks"] == 2 and record["probes"]["same_host"]
    assert record["probes"]["source"] == "probed" and record["probes"]["compute_s"] > 0


@pytest.mark.slow
def test_the_same_config_again_takes_the_cached_probes(auto_run, spark):
    from pipeline.launch.train import resolve_strategy

    cfg, _ = auto_run
    manifest = steps.load_shards(cfg)
    resolved, decision = resolve_strategy(spark, cfg, manifest)
    assert decision.probes.source == "cached"
    assert resolved.train.backend in ("ps", "allreduce") and resolved.ps.placement in ("driver", "hosts")
    assert list((cfg_workdir := __import__("pathlib").Path(cfg.workdir) / "strategy").glob("probes-*.json")), cfg_workdir


@pytest.mark.slow
def test_a_resume_keeps_what_the_checkpoint_fixed(auto_run, spark):
    from pipeline.config.loader import with_changes
    from pipeline.launch.train import resolve_strategy

    cfg, _ = auto_run
    fixed = with_changes(cfg, name="resumable", train={"backend": "ps", "epochs": 1}, ps={"placement": "driver"})
    steps.run_all(spark, fixed)  # its final checkpoint: ps.mode=sync
    again = with_changes(fixed, train={"backend": "auto", "auto": {"allow": ["async"]}},
                         ps={"mode": "auto", "placement": "auto"})
    _, decision = resolve_strategy(spark, again, steps.load_shards(again), resume=True)
    names = {r.candidate.name for r in decision.rows}
    assert names == {"ps driver sync", "ps hosts sync"}  # no allreduce (no server state), async not the checkpoint's
