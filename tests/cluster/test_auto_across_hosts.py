"""train.backend=auto through spark-submit on 2 testbed hosts whose links tc shapes to 200 Mbit/s: the
probes measure those links from the hosts' first tasks, the pick trains, and the run's MLflow record holds
the pick and the whole table."""
import json

import pytest

pytestmark = pytest.mark.slow


def test_auto_probes_the_shaped_links_and_records_its_pick(testbed, cluster_run, tmp_path):
    from mlflow import MlflowClient

    testbed.shape("200mbit")
    try:
        run = cluster_run(["parallelism.data=2", "train.backend=auto", "ps.placement=auto"], executors=2)
        assert run.finish() == 0, run.output[-6000:]
    finally:
        testbed.shape(None)
    assert "train.backend=auto picked" in run.output, run.output[-4000:]
    client = MlflowClient(run.tracking_uri)
    [found] = client.search_runs(client.get_experiment_by_name("shardline").experiment_id)
    pick = found.data.params["strategy.pick"]
    assert pick in ("allreduce", "ps driver sync", "ps hosts sync")
    assert found.data.params["train.backend"] == pick.split()[0]
    table = open(client.download_artifacts(found.info.run_id, "strategy/candidates.md", str(tmp_path))).read()
    for name in ("allreduce", "ps driver sync", "ps hosts sync"):
        assert f"| {name}" in table, table
    probes = json.load(open(client.download_artifacts(found.info.run_id, "strategy/candidates.json",
                                                      str(tmp_path))))["probes"]
    assert probes["hosts"] == 2 and probes["ranks"] == 2 and not probes["same_host"]
    assert probes["shared_cpu"]  # the testbed's hosts are namespaces of this machine's kernel
    # tbf holds each link to 200 Mbit/s: the probe saw that rate, not the veth's own speed
    assert 0.5 * 25e6 <= probes["link_Bps"] <= 1.3 * 25e6, probes
    assert found.data.metrics["test_accuracy"] > 0.8
