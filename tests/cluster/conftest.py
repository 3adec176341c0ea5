"""The multi-host testbed as fixtures: one 3-host cluster for the test session (tests/cluster/testbed.py),
the digits landed on its S3 server once, and `ClusterRun`, a spark-submit job on it that a test can watch
and strike (cut a link, power a host off) while it runs.

Skips, with the reason, where the machine cannot make network namespaces (no root / CAP_NET_ADMIN)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

from tests.cluster.testbed import REPO, Testbed, TestbedUnavailable, unavailable_reason

HOSTS = 3
DIGITS = str(REPO / "conf" / "digits.yaml")
CLICKS = str(REPO / "conf" / "clicks.yaml")
JOB = str(REPO / "jobs" / "run_pipeline.py")
# Small and quick, the same for the testbed and the one-host reference runs.
DIGITS_OVERRIDES = ("train.epochs=8", "tracking.log_model=false", "tracking.system_metrics_interval_s=null")
# The clicks example with its categorical tables as sparse rows on the PS, small enough for a minute.
CLICKS_OVERRIDES = ("data.clicks.rows=20000", "data.clicks.vocab=2000", "data.clicks.big_vocab=20000",
                    "model.hidden=[64]", "ps.sparse.min_rows=50", "tracking.log_model=false",
                    "tracking.system_metrics_interval_s=null")


_RUNNING: list[Testbed] = []


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    """One testbed for every test in tests/cluster/ (session-scoped, so both modules share it; stopped as
    soon as the last of them has run, not at the end of the whole suite)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host testbed unavailable: {reason}")
    bed = Testbed.create(HOSTS, root=str(tmp_path_factory.mktemp("testbed")))
    _RUNNING.append(bed)
    try:
        bed.up()
        _land_digits(bed, tmp_path_factory.mktemp("digits"))
        yield bed
    except TestbedUnavailable as exc:
        pytest.skip(f"multi-host testbed unavailable: {exc}")
    finally:
        bed.down()


def pytest_runtest_teardown(item, nextitem):
    """After the last cluster test, take the testbed down (its JVMs would idle through the rest of the suite)."""
    here = Path(__file__).parent
    if _RUNNING and (nextitem is None or here not in Path(str(nextitem.path)).parents):
        _RUNNING.pop().down()


def _land_digits(bed: Testbed, folder: Path) -> None:
    """The digits as raw Parquet on the testbed's S3 (no host reads the driver's disk)."""
    import pyarrow.fs as pafs

    from pipeline.etl.digits import land_digits

    env = bed.s3_env()
    fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"].split("//", 1)[1], scheme="http",
                           region="us-east-1", access_key=env["AWS_ACCESS_KEY_ID"],
                           secret_key=env["AWS_SECRET_ACCESS_KEY"])
    pafs.copy_files(str(land_digits(folder)), f"{bed.bucket}/raw/digits", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def shared_paths(bed: Testbed, run: str) -> list[str]:
    """Every path the hosts share, on the testbed's S3 under `run`."""
    return ["data.source=parquet", f"data.path={bed.url('raw', 'digits')}",
            f"data.shards_dir={bed.url(run, 'shards')}", f"train.checkpoint_dir={bed.url(run, 'checkpoints')}",
            f"train.model_dir={bed.url(run, 'model')}"]


class ClusterRun:
    """One `spark-submit jobs/run_pipeline.py` on the testbed, its output in a log file read as it grows."""

    def __init__(self, bed: Testbed, folder: Path, overrides: Sequence[str], *, executors: int,
                 conf: Sequence[str] = (), config: str = DIGITS):
        self.bed = bed
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = f"sqlite:///{folder}/mlflow.db"
        self.log_path = folder / "submit.log"
        command = bed.submit_command(JOB, "--config", config, f"workdir={folder / 'work'}",
                                     f"tracking.uri={self.tracking_uri}",
                                     *(DIGITS_OVERRIDES if config == DIGITS else ()), *overrides,
                                     executors=executors, conf=conf)
        self._log = open(self.log_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=folder,
                                     env=bed.submit_env())

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> tuple[re.Match, float]:
        """The first match of `pattern` in the output, and when it appeared (monotonic); fails on timeout
        or when the job ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.search(pattern, self.output)
            if match:
                return match, time.monotonic()
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended ({self.proc.returncode}) before {pattern!r} appeared:\n"
                            f"{self.output[-6000:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{pattern!r} did not appear within {timeout_s:g}s:\n{self.output[-6000:]}")
            time.sleep(0.1)

    def finish(self, timeout_s: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout_s:g}s:\n{self.output[-6000:]}")
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def ranks_hosts(self, timeout_s: float) -> dict[int, str]:
        """{rank: the host it connected to the PS from}, from the newest attempt's connect lines."""
        self.wait_for(r"rank 1 connected from", timeout_s)
        return {int(rank): host for rank, host in re.findall(r"rank (\d+) connected from \('([\d.]+)'", self.output)}

    def test_metrics(self) -> dict:
        match = re.search(r"test metrics: (\{.*\})", self.output)
        assert match, self.output[-6000:]
        return json.loads(match.group(1))

    def ranks(self) -> dict[int, dict]:
        """{rank: {"address": the executor host it ran on, "package": where it imported pipeline from}}."""
        out: dict[int, dict] = {}
        for rank, address in re.findall(r"(\d+)@([\d.]+):\d+/\d+ \(", self.output):
            out.setdefault(int(rank), {})["address"] = address
        for rank, package in re.findall(r"rank (\d+) imported pipeline from (\S+)", self.output):
            out.setdefault(int(rank), {})["package"] = package
        return out


@pytest.fixture
def cluster_run(testbed, tmp_path):
    """`cluster_run(overrides, executors=N)` starts a job (killed at the test's end if still running)."""
    runs: list[ClusterRun] = []

    def start(overrides: Sequence[str], *, executors: int, name: str = "run", conf: Sequence[str] = (),
              config: str = DIGITS) -> ClusterRun:
        run = ClusterRun(testbed, tmp_path / name, [*shared_paths(testbed, f"{tmp_path.name}-{name}"), *overrides],
                         executors=executors, conf=conf, config=config)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()


REFERENCE = """
import json, sys
from pipeline import steps
from pipeline.config import load
from pipeline.session import get_or_create_spark
workdir, cases = sys.argv[1], json.loads(sys.argv[2])
out = {}
for name, (config, overrides) in cases.items():
    cfg = load(config, [f"workdir={workdir}/{name}", f"tracking.uri=sqlite:///{workdir}/{name}/mlflow.db", *overrides])
    out[name] = steps.run_all(get_or_create_spark(cfg.spark), cfg).test_metrics
print("REFERENCE " + json.dumps(out))
"""


@pytest.fixture(scope="session")
def one_host_metrics(testbed, tmp_path_factory):
    """{case: test metrics} of the same configs run on one host (spark-submit --master local[3], the driver's
    disk, the driver-hosted PS): every case in one JVM, computed once. Cases: "<workers>-<backend>" of the
    digits."""
    folder = tmp_path_factory.mktemp("one-host")
    from pipeline.etl.digits import land_digits

    raw = land_digits(folder / "raw")  # the same Parquet the testbed's runs read from S3
    cases = {f"{n}-{backend}": (DIGITS, [*DIGITS_OVERRIDES, "data.source=parquet", f"data.path={raw}",
                                         f"parallelism.data={n}", f"train.backend={backend}"])
             for n in (2, 3) for backend in ("ps", "allreduce")}
    script = folder / "reference.py"
    script.write_text(REFERENCE)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1", "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", "local[3]",
                           "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1", str(script),
                           str(folder), json.dumps(cases)], capture_output=True, text=True, timeout=600,
                          cwd=folder, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(proc.stdout.split("REFERENCE ", 1)[1].splitlines()[0])


@pytest.fixture(scope="session")
def one_host_accuracy(one_host_metrics):
    """`one_host_accuracy(workers, backend)`: the digits' test accuracy on one host (``one_host_metrics``)."""
    return lambda workers, backend: one_host_metrics[f"{workers}-{backend}"]["accuracy"]
