"""A real S3-compatible server for the tests: moto's standalone server (`python -m moto.server`) in a
subprocess on 127.0.0.1, one bucket, and the usual AWS environment chain pointing at it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "shardline-test"
# Not a real key; distinctive, so a test can grep logs for it.
SECRET = "s3cr3t-Shardline-test-key-do-not-log"
ACCESS_KEY = "shardline-test-access"


@dataclass(frozen=True)
class S3:
    endpoint: str
    bucket: str
    env: dict
    log: Path

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *[p.strip("/") for p in parts]])


def env_for(endpoint: str) -> dict:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
            "AWS_ENDPOINT_URL_S3": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
            # no instance-metadata probing (a multi-second timeout where there is no EC2)
            "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def moto_server(folder: Path):
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed (pip install -e '.[test]')")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    log_path = folder / "moto.log"
    log = open(log_path, "wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    saved = {k: os.environ.get(k) for k in env_for(endpoint)}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto server did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        env = env_for(endpoint)
        os.environ.update(env)
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(BUCKET)
        yield S3(endpoint, BUCKET, env, log_path)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
