"""Every block of docs/quickstart.md runs as written, in page order, in a fresh directory that has the
repository's conf/, jobs/ and notebooks/ (as a checkout has): the CLI, batch scoring, the served model
over HTTP, spark-submit, a notebook, the Spark ML estimator and the scheduled workflow."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "quickstart.md"
BLOCK = re.compile(r"<!-- quickstart: ([\w-]+) -->\n```bash\n(.*?)\n```", re.S)
# What each block must print (its own output, not shardline's logs).
EXPECTED = {
    "cli": ["mlflow run id:", "test metrics:", ": champion (no champion yet"],
    "score": ["1797 rows scored"],
    "serve": ['"predictions"', '"probability"'],
    "spark-submit": ["mlflow run id:", "test metrics:"],
    "notebook": ["mlflow run id:", "test metrics:"],
    "spark-ml": ["test metrics:", "prediction"],
    "workflow": ["workflow:", "mlflow run id:"],
}


def blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(PAGE.read_text())


def test_the_page_has_one_block_per_entry_point():
    assert [name for name, _ in blocks()] == list(EXPECTED)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    for folder in ("conf", "jobs", "notebooks"):
        (root / folder).symlink_to(REPO / folder)
    return root


@pytest.fixture(scope="module")
def env():
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if k != "MLFLOW_TRACKING_URI" and not k.startswith(("SHARDLINE_", "PYSPARK_GATEWAY_"))}
    env.update({"PATH": os.pathsep.join([venv_bin, env.get("PATH", "")]), "PYSPARK_PYTHON": sys.executable,
                "PYSPARK_DRIVER_PYTHON": sys.executable, "MLFLOW_DISABLE_TELEMETRY": "true",
                "SPARK_LOCAL_IP": "127.0.0.1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    return env


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_quickstart_block_runs(name, checkout, env):
    script = dict(blocks())[name]
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=checkout, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    output = proc.stdout
    assert proc.returncode == 0, f"block {name!r} exited {proc.returncode}:\n{output[-6000:]}"
    for expected in EXPECTED[name]:
        assert expected in output, f"block {name!r} did not print {expected!r}:\n{output[-6000:]}"
