"""The clicks example with its categorical tables as sparse rows, spread over the shards on 2 testbed hosts
(ps.placement=hosts): each host's shard holds the rows hashed to it, and the run scores the ROC AUC of the
driver-hosted tables on one host."""
import re

import pytest

from tests.cluster.conftest import CLICKS, CLICKS_OVERRIDES

pytestmark = pytest.mark.slow


def test_sparse_tables_spread_over_two_hosts_score_like_the_driver_hosted_ones(testbed, cluster_run,
                                                                              one_host_metrics, reference_dir):
    reference = one_host_metrics["clicks-2"]["roc_auc"]  # it generated the click log this run reads
    # Typed features encode through a scratch folder every executor shares, which S3 is not: the testbed's
    # hosts are namespaces of one machine, so a local folder is that shared disk (workdir_on_every_host).
    run = cluster_run([*CLICKS_OVERRIDES, "data.source=parquet", f"data.path={reference_dir / 'clicks-raw'}",
                       "workdir_on_every_host=true", f"data.shards_dir={reference_dir / 'testbed-shards'}",
                       "parallelism.data=2", "ps.placement=hosts"], executors=2, config=CLICKS)
    assert run.finish() == 0, run.output[-6000:]
    output = run.output
    auc = run.test_metrics()["roc_auc"]
    print(f"clicks test ROC AUC: sparse tables on 2 hosts' shards {auc:.4f}, driver-hosted on one host {reference:.4f}")
    assert abs(auc - reference) <= 0.005, (auc, reference)
    rows = re.search(r"sparse table rows per shard: (.+)", output)
    assert rows, output[-4000:]
    per_host = dict(part.rsplit(" ", 1) for part in rows.group(1).strip().split(", "))
    assert len(per_host) == 2 and set(per_host) <= {h.address for h in testbed.hosts}, per_host
    counts = [int(n) for n in per_host.values()]
    assert min(counts) > 0.4 * sum(counts), per_host  # the rows hashed evenly over both hosts' shards
