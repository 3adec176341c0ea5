"""bench/_process_barrier.py: the SparkSession stand-in whose barrier tasks run in reused processes. Real
processes throughout: the allGather every rank sees, results in rank order, a task process kept for the
next job (as Spark reuses its Python workers), a failing or interrupted task as an error naming its rank,
and the launch code's view of the session. No timing asserts."""
from __future__ import annotations

import threading

import pytest


@pytest.fixture(scope="module")
def barrier(load_bench):
    return load_bench("_process_barrier")


@pytest.fixture(scope="module")
def session(barrier):
    s = barrier.ProcessBarrierSession(3, job_timeout_s=120)
    yield s
    s.stop()


def _gather_task():
    def task(batches):
        import os

        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        context = BarrierTaskContext.get()
        rank = context.partitionId()
        seen = context.allGather(f"from {rank}")
        again = context.allGather(str(rank * 10))
        context.barrier()
        yield pa.RecordBatch.from_pylist([{"rank": rank, "seen": "|".join(seen), "again": "|".join(again),
                                           "pid": os.getpid(), "omp": os.environ.get("OMP_NUM_THREADS")}])

    return task


def test_every_rank_sees_every_rank_s_message_and_processes_are_reused(session):
    job = lambda: session.range(0, 3, 1, 3).mapInArrow(_gather_task(), "unused", barrier=True).collect()  # noqa: E731
    first = [r.asDict() for r in job()]
    assert [r["rank"] for r in first] == [0, 1, 2]
    assert all(r["seen"] == "from 0|from 1|from 2" and r["again"] == "0|10|20" for r in first)
    assert {r["omp"] for r in first} == {"1"}  # as Spark sets it for spark.task.cpus=1
    second = [r.asDict() for r in job()]
    assert [r["pid"] for r in second] == [r["pid"] for r in first]  # the same task processes, warm
    assert len({r["pid"] for r in first}) == 3


def test_a_failing_task_names_its_rank_and_the_next_job_gets_new_processes(session):
    def task(batches):
        from pyspark import BarrierTaskContext

        if BarrierTaskContext.get().partitionId() == 1:
            raise RuntimeError("rank one broke on purpose")
        import pyarrow as pa

        yield pa.RecordBatch.from_pylist([{"ok": 1}])

    with pytest.raises(session_error(session), match=r"rank 1 .*failed(.|\n)*rank one broke on purpose"):
        session.range(0, 2, 1, 2).mapInArrow(task, "unused", barrier=True).collect()
    rows = session.range(0, 3, 1, 3).mapInArrow(_gather_task(), "unused", barrier=True).collect()
    assert [r["rank"] for r in rows] == [0, 1, 2]


def session_error(session):
    import sys

    return sys.modules[type(session).__module__].TaskProcessError


def test_interrupting_the_job_s_tag_ends_its_tasks(session):
    def task(batches):
        import time

        time.sleep(60)
        yield from ()

    session.addTag("job-1")
    timer = threading.Timer(3.0, session.interruptTag, args=("job-1",))
    timer.start()
    try:
        with pytest.raises(session_error(session), match="rank"):
            session.range(0, 2, 1, 2).mapInArrow(task, "unused", barrier=True).collect()
    finally:
        timer.cancel()
        session.removeTag("job-1")


def test_the_launch_code_reads_a_local_master_with_these_slots(session, barrier):
    from pipeline.launch.placement.ps_address import local_master, ps_host
    from pipeline.launch.preflight import task_slots

    assert task_slots(session) == 3 and local_master(session)
    assert session.conf.get("spark.driver.host") == "127.0.0.1"
    with pytest.raises(ValueError, match="4 tasks does not fit 3 slots"):
        session.workers(4)
    with pytest.raises(ValueError, match="barrier stages only"):
        session.range(0, 1).mapInArrow(_gather_task(), "unused")

    class Cfg:
        class ps:  # noqa: N801 - the config's section name
            host = None

        class spark:  # noqa: N801
            master = "local[3]"

    assert ps_host(session, Cfg) == "127.0.0.1"
