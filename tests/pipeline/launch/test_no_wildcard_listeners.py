"""No process of a run listens on a wildcard address: a tiny allreduce job and a tiny ps job on local Spark,
with the LISTEN sockets of the driver and of Spark's Python workers sampled while they train."""
import os
import threading
import time

import pytest

from pipeline.config import build
from pipeline.etl import run_etl
from pipeline.launch import train
from tests.pipeline.listeners import descendants, listening, python_processes, wildcard_listeners

pytestmark = pytest.mark.slow


def _run_processes(spark) -> list[int]:
    """This driver process and the Python processes Spark's JVM forked (daemon and workers)."""
    jvm = spark.sparkContext._gateway.proc.pid
    return [os.getpid()] + python_processes(descendants(jvm))


def _sampled(spark, cfg, manifest):
    """Train ``cfg`` while sampling the run's listeners every 20 ms; (all seen, wildcard ones seen)."""
    seen, wild, done, errors = set(), set(), threading.Event(), []

    def run():
        try:
            train(spark, cfg, manifest)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    while not done.is_set():
        pids = _run_processes(spark)
        seen.update((a, p) for _, a, p in listening(pids))
        wild.update(wildcard_listeners(pids))
        time.sleep(0.02)
    worker.join()
    if errors:
        raise errors[0]
    return seen, wild


@pytest.fixture(scope="module")
def tiny(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("listeners")
    cfg = build({"name": "listeners", "workdir": str(work), "parallelism": {"data": 2},
                 "data": {"source": "digits"}, "model": {"hidden": [16]},
                 "train": {"epochs": 2, "batch_size": 64}, "ps": {"timeout_s": 30}})
    return cfg, run_etl(spark, cfg)


@pytest.mark.parametrize("backend", ["allreduce", "ps"])
def test_no_listener_of_the_run_is_on_a_wildcard_address(spark, tiny, backend):
    cfg, manifest = tiny
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"backend": backend})})
    seen, wild = _sampled(spark, cfg, manifest)
    assert wild == set(), f"listening on a wildcard address: {sorted(wild)}"
    # The scan saw the run's own listeners (the PS; for allreduce the store and gloo's pairs), all on the
    # task/driver address.
    assert seen and all(address == "127.0.0.1" for address, _ in seen), sorted(seen)
