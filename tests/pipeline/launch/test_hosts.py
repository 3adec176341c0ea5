"""Which paths a step's executors need (launch.hosts.executor_paths), and that the shared-storage check
leaves a one-host session alone. The refusal on a real multi-host cluster: tests/cluster/."""
from pipeline.config import load
from pipeline.launch.hosts import check_shared_storage, executor_paths


def _cfg(conf_dir, *overrides):
    return load(f"{conf_dir}/digits.yaml", ["workdir=/w", *overrides])


def test_the_etl_needs_its_source_and_shard_set_and_training_its_shard_set(conf_dir):
    cfg = _cfg(conf_dir)
    assert executor_paths(cfg, etl=True) == [("workdir", "/w/shards/digits"), ("workdir", "/w/raw/digits")]
    assert executor_paths(cfg, etl=False) == [("workdir", "/w/shards/digits")]
    moved = _cfg(conf_dir, "data.source=parquet", "data.path=s3://lake/raw", "data.shards_dir=/mnt/shards")
    assert executor_paths(moved, etl=True) == [("data.shards_dir", "/mnt/shards"), ("data.path", "s3://lake/raw")]


def test_a_task_hosted_ps_also_needs_the_checkpoints(conf_dir):
    cfg = _cfg(conf_dir, "ps.placement=task")
    assert ("workdir", "/w/checkpoints/digits") in executor_paths(cfg, etl=False)
    cfg = _cfg(conf_dir, "ps.placement=task", "train.checkpoint_dir=s3://lake/ckpt")
    assert ("train.checkpoint_dir", "s3://lake/ckpt") in executor_paths(cfg, etl=False)


def test_a_one_host_session_keeps_its_local_paths(spark, conf_dir):
    check_shared_storage(spark, _cfg(conf_dir), etl=True)  # local[2]: the driver is the only host
