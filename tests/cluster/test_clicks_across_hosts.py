"""The clicks example with its categorical tables as sparse rows, spread over the shards on 2 testbed hosts
(ps.placement=hosts): each host's shard holds the rows hashed to it, and the run scores the ROC AUC of the
same run with the tables beside the driver's PS, on the same cluster and shards."""
import re

import pytest

from tests.cluster.conftest import CLICKS, CLICKS_OVERRIDES

pytestmark = pytest.mark.slow


def test_sparse_tables_spread_over_two_hosts_score_like_the_driver_hosted_ones(testbed, cluster_run, tmp_path):
    # Typed features encode through a scratch folder every executor shares, which S3 is not: the testbed's
    # hosts are namespaces of one machine, so a local folder is that shared disk (workdir_on_every_host).
    # The click log is generated there by the first run; the second reuses it and its shards.
    shared = [*CLICKS_OVERRIDES, "data.source=clicks", f"data.path={tmp_path / 'clicks-raw'}",
              "workdir_on_every_host=true", f"data.shards_dir={tmp_path / 'shards'}", "parallelism.data=2"]
    spread = cluster_run([*shared, "ps.placement=hosts"], executors=2, config=CLICKS, name="hosts")
    assert spread.finish() == 0, spread.output[-6000:]
    driver = cluster_run([*shared, "ps.placement=driver"], executors=2, config=CLICKS, name="driver")
    assert driver.finish() == 0, driver.output[-6000:]
    auc, reference = spread.test_metrics()["roc_auc"], driver.test_metrics()["roc_auc"]
    print(f"clicks test ROC AUC: sparse tables on 2 hosts' shards {auc:.4f}, beside the driver's PS {reference:.4f}")
    assert abs(auc - reference) <= 0.005, (auc, reference)
    rows = re.search(r"sparse table rows per shard: (.+)", spread.output)
    assert rows, spread.output[-4000:]
    per_host = dict(part.rsplit(" ", 1) for part in rows.group(1).strip().split(", "))
    assert len(per_host) == 2 and set(per_host) <= {h.address for h in testbed.hosts}, per_host
    counts = [int(n) for n in per_host.values()]
    assert min(counts) > 0.4 * sum(counts), per_host  # the rows hashed evenly over both hosts' shards
