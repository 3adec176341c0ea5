"""Checks before a barrier stage starts: a barrier stage with more tasks than slots never runs."""
from __future__ import annotations

import os
import re
from typing import Optional

from pipeline.errors import ConfigError


def _conf(spark, key: str) -> Optional[str]:
    try:
        return spark.conf.get(key, None)
    except Exception:  # Connect sessions refuse some static keys; treat as unset
        return None


def task_slots(spark) -> Optional[int]:
    """Concurrent task slots the session can give a barrier stage, or None when it cannot be known."""
    master = _conf(spark, "spark.master") or ""
    task_cpus = int(_conf(spark, "spark.task.cpus") or 1)
    match = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master)
    if match:
        cores = match.group(1)
        total = 1 if cores is None else (os.cpu_count() or 1) if cores == "*" else int(cores)
        return total // task_cpus
    match = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*(\d+)\]", master)
    if match:
        return int(match.group(1)) * (int(match.group(2)) // task_cpus)
    instances, cores = _conf(spark, "spark.executor.instances"), _conf(spark, "spark.executor.cores")
    if instances and cores:
        return int(instances) * (int(cores) // task_cpus)
    return None


def check_barrier_slots(spark, workers: int, asked: str | None = None) -> None:
    """Fail fast, naming slots and workers, instead of letting Spark retry an unschedulable barrier stage.

    asked names what set the task count (default: parallelism.data)."""
    if (_conf(spark, "spark.dynamicAllocation.enabled") or "false").lower() == "true":
        raise ConfigError("barrier training needs spark.dynamicAllocation.enabled=false "
                          "(Spark cannot gang-schedule a barrier stage under dynamic allocation)")
    slots = task_slots(spark)
    if slots is not None and workers > slots:
        asked = asked or f"parallelism.data={workers} workers"
        raise ConfigError(f"{asked} need {workers} concurrent task slots, but this "
                          f"Spark session has {slots} (master {_conf(spark, 'spark.master')}, spark.task.cpus "
                          f"{_conf(spark, 'spark.task.cpus') or 1}); lower parallelism.data"
                          f"{'/pipeline' if 'pipeline' in asked else ''} or add executors/cores")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
               "t": 1 << 40, "tb": 1 << 40}


def _bytes(text: str) -> Optional[int]:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def check_result_size(spark, parameter_bytes: int, why: str) -> None:
    """The final parameters come back through collect() (allreduce, ps.placement=task): refuse up front
    when they cannot fit spark.driver.maxResultSize, instead of failing after all the training."""
    limit = _bytes(_conf(spark, "spark.driver.maxResultSize") or "1g")
    if limit and parameter_bytes > 0.9 * limit:  # 0 means unlimited; keep room for the other result rows
        raise ConfigError(f"{why}, the final parameters ({parameter_bytes / 2**20:.0f} MiB) come back as result rows, "
                          f"but spark.driver.maxResultSize is {_conf(spark, 'spark.driver.maxResultSize') or '1g'}; "
                          "raise spark.driver.maxResultSize (or 0 for no limit)")
