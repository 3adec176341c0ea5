"""Driver side: the paths a step's executors need must be on storage their hosts share.

On a cluster whose executors live on other hosts than the driver (``pipeline.executors`` says where they
are), every path the executors read or write must be on storage they share: a local workdir is refused
at once, naming `workdir` and the fix, instead of failing later on a missing shard.
"""
from __future__ import annotations

from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError
from pipeline.executors import is_local_master, wait_for_executors
from pipeline.storage import is_remote


def executor_paths(cfg: PipelineConfig, *, etl: bool) -> list[tuple[str, str]]:
    """(config key, path) of every path executors read or write in this step: the ETL's source and the
    shard set it writes; training's shard set, and its checkpoints where the PS runs in a task."""
    where = Workdir.of(cfg)
    data = cfg.data
    paths = [("data.shards_dir" if data.shards_dir else "workdir", str(where.shards))]
    if etl:
        generated = {"digits": where.raw_digits, "digits_images": where.raw_digits_images,
                     "synthetic": where.raw_synthetic, "clicks": where.raw_clicks}
        if data.source in generated:
            paths.append(("data.path" if data.path else "workdir", str(generated[data.source])))
        elif data.source != "table" and data.path:
            paths.append(("data.path", data.path))
    if not etl and cfg.ps.placement == "task":
        paths.append(("train.checkpoint_dir" if cfg.train.checkpoint_dir else "workdir", where.checkpoints))
    return paths


def check_shared_storage(spark, cfg: PipelineConfig, *, etl: bool) -> None:
    """Refuse local paths that executors on other hosts would need (unless ``workdir_on_every_host``)."""
    if cfg.workdir_on_every_host or is_local_master(spark):
        return
    local = [(key, path) for key, path in executor_paths(cfg, etl=etl)
             if not is_remote(path) and not path.startswith(("dbfs:", "/dbfs/"))]
    if not local:
        return
    view = wait_for_executors(spark)
    if view is None or not view.remote_hosts:
        return
    keys = sorted({key for key, _ in local})
    listed = "; ".join(f"{path} ({key})" for key, path in local)
    raise ConfigError(
        f"{' and '.join(keys)} point at local paths ({listed}), but this cluster runs executors on other hosts "
        f"({', '.join(view.remote_hosts)}) than the driver ({view.driver}), and those hosts cannot read this "
        f"machine's disk. Put what the hosts share on shared storage: workdir's shard set as "
        f"data.shards_dir=s3://<bucket>/shards/{cfg.name}, the source as data.source=parquet with "
        f"data.path=s3://... (and train.checkpoint_dir, train.model_dir on it too); or, if workdir={cfg.workdir} "
        "is a mount every host has (NFS, /dbfs), set workdir_on_every_host=true")
