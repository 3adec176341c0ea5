"""A real Spark Connect server whose driver advertises an address that is not this client's (as a remote
server would): the client's PS must not take the server's spark.driver.host for its own."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
SERVER_DRIVER_HOST = "192.0.2.10"  # TEST-NET-1: never this machine

CLIENT = """
import json, sys
sys.path.insert(0, {repo!r})
from pipeline.config import build
from pipeline.errors import ConfigError
from pipeline.launch.placement.driver_hosted import ps_host  # where the PS placement takes it
from pipeline.session import get_or_create_spark
cfg = build({{"name": "offhost", "spark": {{"master": {url!r}}}}})
spark = get_or_create_spark(cfg.spark)
out = {{"server_driver_host": spark.conf.get("spark.driver.host")}}
try:
    out["chosen"] = ps_host(spark, cfg)
except ConfigError as exc:
    out["error"] = str(exc)
own = cfg.model_copy(update={{"ps": cfg.ps.model_copy(update={{"host": "127.0.0.1"}})}})
out["with_ps_host"] = ps_host(spark, own)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def off_host_connect_url(tmp_path_factory, connect_server):
    with connect_server(tmp_path_factory.mktemp("connect-off-host"), master="local[1]", ident="offhost",
                        conf={"spark.driver.host": SERVER_DRIVER_HOST, "spark.driver.bindAddress": "127.0.0.1"}) as url:
        yield url


def test_the_servers_driver_host_is_not_taken_for_the_clients_ps_address(off_host_connect_url, tmp_path):
    script = CLIENT.format(repo=str(REPO), url=off_host_connect_url)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["server_driver_host"] == SERVER_DRIVER_HOST
    # This client reaches the server over loopback only: no address the executors could use, so a clear
    # error naming ps.host (before: the PS tried to bind 192.0.2.10 in this process).
    assert "chosen" not in result, result
    assert "set ps.host to an address of this machine" in result["error"]
    assert result["with_ps_host"] == "127.0.0.1"
