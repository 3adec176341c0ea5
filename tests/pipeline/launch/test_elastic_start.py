"""train.min_workers: fewer task slots than parallelism.data still trains (with what is there, >= the
minimum) or refuses clearly. The end to end (WARNING, MLflow params) is in test_elastic_resume.py, on its
shard set."""
import pytest

from pipeline.config import build, with_changes
from pipeline.errors import ConfigError
from pipeline.launch.elastic import fit_workers


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic-start")
    return build({"name": "three", "workdir": str(work), "parallelism": {"data": 3}, "data": {"source": "digits"},
                  "model": {"hidden": [32]}, "train": {"epochs": 1, "batch_size": 32, "min_workers": 2},
                  "ps": {"timeout_s": 20}})


def test_min_workers_decides_between_fewer_workers_and_a_clear_error(spark, three):
    # the session is local[2]: two slots for three asked workers
    assert fit_workers(spark, three).parallelism.data == 2
    assert fit_workers(spark, with_changes(three, parallelism={"data": 2})).parallelism.data == 2  # enough slots
    with pytest.raises(ConfigError, match=r"parallelism.data=3 workers asked, train.min_workers=3 .* 2 task slot"):
        fit_workers(spark, with_changes(three, train={"min_workers": 3}))
    with pytest.raises(ConfigError, match=r"train.min_workers=4 is more than parallelism.data=3"):
        fit_workers(spark, with_changes(three, train={"min_workers": 4}))
    unset = with_changes(three, train={"min_workers": None})
    assert fit_workers(spark, unset) is unset  # the barrier preflight then refuses, as before
