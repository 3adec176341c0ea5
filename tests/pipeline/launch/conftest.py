"""Fixtures shared by the launch tests."""
import contextlib
import os

import pytest


@pytest.fixture(scope="module")
def user_models(spark):
    """tests/pipeline/models/user_models.py importable as `user_models` here and in the Python workers."""
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "user_models.py")
    sys.path.insert(0, os.path.dirname(path))
    spark.sparkContext.addPyFile(path)
    yield "user_models"
    sys.path.remove(os.path.dirname(path))


@contextlib.contextmanager
def _connect_server(logs, *, master: str, conf: dict, ident: str = "shardline"):
    """A real Spark Connect server (the pip pyspark's sbin scripts) on a free 127.0.0.1 port; yields its
    sc:// URL once its log says it started, and stops it on the way out."""
    import socket
    import subprocess
    import sys
    import time

    import pyspark

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    home = os.path.dirname(pyspark.__file__)
    env = {**os.environ, "SPARK_HOME": home, "SPARK_LOG_DIR": str(logs), "SPARK_PID_DIR": str(logs),
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_IDENT_STRING": ident,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    settings = {"spark.connect.grpc.binding.address": "127.0.0.1", "spark.connect.grpc.binding.port": str(port),
                "spark.ui.enabled": "false", **conf}
    subprocess.run([os.path.join(home, "sbin", "start-connect-server.sh"), "--master", master,
                    *[arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}")]],
                   env=env, check=True, capture_output=True)
    try:
        deadline = time.monotonic() + 120
        while not any("Spark Connect server started" in p.read_text(errors="replace") for p in logs.glob("*.out")):
            assert time.monotonic() < deadline, "\n".join(p.read_text()[-3000:] for p in logs.glob("*.out"))
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        subprocess.run([os.path.join(home, "sbin", "stop-connect-server.sh")], env=env, capture_output=True)


@pytest.fixture(scope="module")
def connect_server():
    """``connect_server(logs, master=..., conf={...})``: a context manager starting a real Connect server."""
    return _connect_server
