"""Shared fixtures: one embedded SparkSession for the whole test session, small and quiet."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("shardline-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def conf_dir():
    return os.path.join(REPO, "conf")


class ServerURI(str):
    """The server's URI (a str, usable as a tracking URI) that also knows where its artifacts land."""

    artifacts: "os.PathLike"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (SQLite backend, artifacts proxied to a temp dir); yields its
    URI (with `.artifacts`: the directory the server stores artifacts in)."""
    import socket
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = ServerURI(f"http://127.0.0.1:{port}")
    uri.artifacts = root / "artifacts"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no huey consumer: fast shutdown
    log = open(root / "server.log", "wb")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/server.db",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=log, cwd=root, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not come up:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield uri
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-compatible server (moto's standalone server) on 127.0.0.1 with one bucket; the AWS_*
    environment chain points at it for the session (driver, and Spark's Python workers via `s3_spark`)."""
    from tests.s3_server import moto_server

    with moto_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_spark(spark, s3):
    """The session's Spark with the S3 environment in its Python workers' env too: a worker inherits the
    JVM's environment, fixed when the JVM started, plus SparkContext.environment, which is read each time
    a Python function is shipped (so this reaches workers of a session started before the server)."""
    spark.sparkContext.environment.update(s3.env)
    try:
        yield spark
    finally:
        for key in s3.env:
            spark.sparkContext.environment.pop(key, None)
