import pytest

from pipeline.errors import ConfigError
from pipeline.launch.preflight import check_barrier_slots, task_slots


class FakeConf:
    def __init__(self, values):
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)


class FakeSession:  # only spark.conf.get is used by the preflight
    def __init__(self, **values):
        self.conf = FakeConf({k.replace("_", "."): v for k, v in values.items()})


@pytest.mark.parametrize("master, cpus, expected", [
    ("local", None, 1), ("local[4]", None, 4), ("local[4]", "2", 2), ("local[3,2]", None, 3),
    ("local-cluster[2,1,1024]", None, 2), ("local-cluster[2, 4, 1024]", "2", 4), ("yarn", None, None),
])
def test_task_slots_from_master(master, cpus, expected):
    values = {"spark_master": master}
    if cpus:
        values["spark_task_cpus"] = cpus
    assert task_slots(FakeSession(**values)) == expected


def test_executor_settings_and_dynamic_allocation():
    session = FakeSession(spark_master="yarn", spark_executor_instances="3", spark_executor_cores="2")
    assert task_slots(session) == 6
    check_barrier_slots(session, 6)
    with pytest.raises(ConfigError, match="has 6"):
        check_barrier_slots(session, 7)
    dynamic = FakeSession(spark_master="yarn", spark_dynamicAllocation_enabled="true")
    with pytest.raises(ConfigError, match="spark.dynamicAllocation.enabled=false"):
        check_barrier_slots(dynamic, 1)


def test_final_parameters_must_fit_max_result_size():
    from pipeline.launch.preflight import check_result_size

    check_result_size(FakeSession(), 500 << 20, "with ps.placement=task")  # default 1g
    with pytest.raises(ConfigError, match=r"\(1000 MiB\).*spark.driver.maxResultSize is 1g"):
        check_result_size(FakeSession(), 1000 << 20, "with ps.placement=task")
    check_result_size(FakeSession(spark_driver_maxResultSize="4g"), 1000 << 20, "x")
    check_result_size(FakeSession(spark_driver_maxResultSize="0"), 100 << 30, "x")  # 0: no limit
    with pytest.raises(ConfigError, match="with train.backend=allreduce.*is 512m"):
        check_result_size(FakeSession(spark_driver_maxResultSize="512m"), 500 << 20, "with train.backend=allreduce")
