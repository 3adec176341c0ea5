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
