"""No process of a run listens on a wildcard address: a tiny allreduce job and a tiny ps job on local Spark,
with the LISTEN sockets of the driver, Spark's JVM and Spark's Python workers sampled while they train.

The JVM's own ports (block manager, RPC, Py4J) follow spark.driver.bindAddress, which the test session
sets to 127.0.0.1 with the UI off (conftest.py): the configuration the README's Security section asks for."""
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
    """This driver process, Spark's JVM and the Python processes it forked (daemon and workers)."""
    jvm = spark.sparkContext._gateway.proc.pid
    return [os.getpid(), jvm] + python_processes(descendants(jvm))


def _sampled(spark, cfg, manifest):
    """Train ``cfg`` while sampling the run's listeners every 20 ms; (all seen, wildcard ones seen, those of
    Spark's Python workers)."""
    seen, wild, in_workers, done, errors = set(), set(), set(), threading.Event(), []

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
        found = listening(pids)
        seen.update((a, p) for _, a, p in found)
        in_workers.update((a, p) for pid, a, p in found if pid not in pids[:2])
        wild.update(wildcard_listeners(pids))
        time.sleep(0.02)
    worker.join()
    if errors:
        raise errors[0]
    return seen, wild, in_workers


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
    seen, wild, in_workers = _sampled(spark, cfg, manifest)
    assert wild == set(), f"listening on a wildcard address: {sorted(wild)}"
    # The scan saw the run's listeners (the PS; for allreduce the store and gloo's pairs; Spark's), all on
    # the task/driver address (the JVM's as IPv4-mapped ::ffff:127.0.0.1).
    assert seen and all(address.removeprefix("::ffff:") == "127.0.0.1" for address, _ in seen), sorted(seen)
    if backend == "allreduce":  # the group's store and gloo's pair listeners, in the barrier tasks
        assert in_workers, sorted(seen)
