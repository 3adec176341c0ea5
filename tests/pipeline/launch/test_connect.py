"""The same launch path through a Spark Connect session (no SparkContext, no RDDs): a real Connect server
from the pip pyspark on 127.0.0.1, the digits pipeline run by a client in its own process."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

CLIENT = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
logging.getLogger("pipeline.launch").setLevel(logging.INFO)
sys.path.insert(0, {repo!r})
from pipeline.config import build
from pipeline.errors import ConfigError
from pipeline.session import get_or_create_spark
from pipeline import steps
cfg = build({{"name": "connect", "workdir": {work!r}, "spark": {{"master": {url!r}}}, "parallelism": {{"data": 2}},
             "data": {{"source": "digits"}}, "model": {{"hidden": [128, 64]}},
             "train": {{"epochs": 12, "batch_size": 16}}, "tracking": {{"log_model": False}},
             "ps": {{"placement": {placement!r}}}}})
spark = get_or_create_spark(cfg.spark)
assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
outcome = steps.run_all(spark, cfg)
too_many = cfg.model_copy(update={{"parallelism": cfg.parallelism.model_copy(update={{"data": 3}})}})
try:
    steps.train(spark, too_many)
    preflight = "no error"
except ConfigError as exc:
    preflight = str(exc)
print("RESULT " + json.dumps({{"metrics": outcome.test_metrics, "preflight": preflight}}))
"""


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory, connect_server):
    with connect_server(tmp_path_factory.mktemp("connect"), master="local[2]",
                        conf={"spark.sql.shuffle.partitions": "2"}) as url:
        yield url


@pytest.mark.parametrize("placement", ["driver", "task"])
def test_digits_pipeline_through_spark_connect(connect_url, tmp_path, placement):
    """PS in the client process (driver placement) or inside rank 0's barrier task (task placement)."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "MLFLOW_DISABLE_TELEMETRY": "true"}
    script = CLIENT.format(repo=str(REPO), work=str(tmp_path / "work"), url=connect_url, placement=placement)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    import json

    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["metrics"]["accuracy"] >= 0.95, result
    where = "PS in rank 0's task (ps.placement=task)" if placement == "task" else "parameters, PS on "
    assert where in proc.stderr, proc.stderr[-3000:]
    # Preflight fails fast on Connect too (Spark itself would retry the barrier stage for ~10 minutes).
    assert "parallelism.data=3 workers need 3 concurrent task slots" in result["preflight"]
    assert "has 2" in result["preflight"]


def test_launch_code_never_touches_spark_context_or_rdds():
    """One launch path for classic and Connect sessions: nothing in launch/worker/ps reaches for the
    SparkContext or the RDD API (which Connect sessions do not have)."""
    offenders = []
    for folder in ("launch", "worker", "ps"):
        for path in sorted((REPO / "pipeline" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("sparkContext", "rdd", "_jsc", "_jvm"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert offenders == []
    probe = ast.parse("spark.sparkContext.defaultParallelism\ndf.rdd.barrier()")
    found = [n.attr for n in ast.walk(probe) if isinstance(n, ast.Attribute) and n.attr in ("sparkContext", "rdd")]
    assert sorted(found) == ["rdd", "sparkContext"]  # the scan does see such accesses
