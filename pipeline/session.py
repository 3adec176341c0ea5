"""The SparkSession: reuse the active one (spark-submit, notebooks), else build the embedded default."""
from __future__ import annotations

import logging
import os
import sys

from pipeline.config.schema import SparkConfig

log = logging.getLogger(__name__)


def get_or_create_spark(config: SparkConfig):
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # Executors must run this interpreter, or they miss the packages installed next to it.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if config.master.startswith("sc://"):  # a Spark Connect server: a remote session, no SparkContext
        spark = SparkSession.builder.remote(config.master).getOrCreate()
        log.info("spark connect session: %s, version %s", config.master, spark.version)
        return spark
    builder = SparkSession.builder.appName(config.app_name)
    # Under spark-submit the JVM gateway already exists and --master must win over the config.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(config.master)
    for key, value in config.conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    log.info("spark session: master=%s, version %s", spark.conf.get("spark.master", config.master), spark.version)
    return spark
