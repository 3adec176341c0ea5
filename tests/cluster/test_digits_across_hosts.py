"""The digits pipeline through spark-submit on the multi-host testbed: 2 and 3 hosts, both backends, and
the PS over TLS. Every rank runs on its own host, imports `pipeline` from the wheel spark-submit shipped
(not the driver's checkout), and the run reaches the one-host run's test accuracy."""
import re
from pathlib import Path

import pytest

from tests.cluster.testbed import REPO

pytestmark = pytest.mark.slow


# The driver-hosted PS on 2 hosts runs over TLS only: plain TCP is 3-ps's, and every run here costs a whole
# spark-submit (the multi-host tests' share of CI is kept to about ten minutes).
@pytest.mark.parametrize("hosts, backend, tls, placement",
                         [(2, "allreduce", False, "driver"), (2, "ps", True, "driver"), (3, "ps", False, "driver"),
                          (3, "allreduce", False, "driver"), (2, "ps", True, "hosts"), (3, "ps", False, "hosts")],
                         ids=["2-allreduce", "2-ps-tls", "3-ps", "3-allreduce", "2-ps-hosts-tls", "3-ps-hosts"])
def test_digits_trains_across_hosts_as_on_one(testbed, cluster_run, one_host_accuracy, hosts, backend, tls,
                                              placement):
    run = cluster_run([f"parallelism.data={hosts}", f"train.backend={backend}", f"ps.tls={str(tls).lower()}",
                       f"ps.placement={placement}"], executors=hosts)
    assert run.finish() == 0, run.output[-6000:]
    output = run.output
    accuracy = run.test_metrics()["accuracy"]
    reference = one_host_accuracy(hosts, backend)
    assert abs(accuracy - reference) <= 0.005, (accuracy, reference)

    ranks = run.ranks()
    assert sorted(ranks) == list(range(hosts)), output[-4000:]
    addresses = {r["address"] for r in ranks.values()}
    worker_dirs = {h.address: h.worker_dir for h in testbed.hosts}
    assert len(addresses) == hosts and addresses <= set(worker_dirs), ranks  # one rank per host
    for info in ranks.values():
        package = Path(info["package"])
        # the shipped wheel, as its host's Spark worker fetched it into its own folder; never the checkout
        assert package.parts[-3:] == ("shardline.zip", "pipeline", "__init__.py"), info
        assert str(package).startswith(worker_dirs[info["address"]] + "/"), info
        assert not str(package).startswith(str(REPO) + "/"), info
    if placement == "hosts":  # one shard per host, started there (their connect lines are in the executors' logs)
        spread = re.search(r"parameter-server shards were on (.+)", output)
        assert spread and set(spread.group(1).strip().split(", ")) == addresses, output[-4000:]
        return
    wire = "TLS" if tls else "plain TCP"
    connected = [line for line in output.splitlines() if "connected from" in line]
    assert connected and all(wire in line for line in connected), connected
    assert {line.split("('", 1)[1].split("'", 1)[0] for line in connected} == addresses


def test_a_local_workdir_on_a_multi_host_cluster_is_refused_at_once(testbed, cluster_run):
    run = cluster_run(["parallelism.data=2", "data.source=digits", "data.path=null", "data.shards_dir=null"],
                      executors=2)
    assert run.finish() != 0
    output = run.output
    assert "workdir" in output and "point at local paths" in output, output[-4000:]
    assert "data.shards_dir=s3://" in output and "workdir_on_every_host=true" in output
    assert "barrier attempt" not in output  # refused before training, in the ETL step
