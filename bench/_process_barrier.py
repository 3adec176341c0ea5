"""A stand-in for the few SparkSession calls ``pipeline.launch.train`` makes, for a machine without Spark:
the barrier stage's N tasks run as N Python processes of their own, and everything else is shardline's.

Why it exists: issue 17 asks for the scaling figures at 4 and 8 workers on the 16-core machine the
`device` tool lends, and that machine has no Java and no pyspark (nor a way to fetch them; what travels
there is capped at 64 MiB and pyspark alone is ~400 MB). What the bench measures there is shardline's
own code all the same: ``train()``, the driver-hosted PS, its watchdog and progress, the task body
(``pipeline.launch.task.body.make_task_fn``, cloudpickled as Spark ships it), the worker loop, loader,
wire and allreduce. What this replaces is how the tasks start (Spark forks Python workers from its
daemon; these are spawned, ``OMP_NUM_THREADS=1`` as Spark sets it for ``spark.task.cpus=1``) and
``BarrierTaskContext.allGather`` (here through files in the job's scratch folder). Like Spark's Python
workers (``spark.python.worker.reuse``, on by default), a task process outlives its job and takes the
next one: a fresh process pays its first steps' one-time costs inside the loop (0.25-0.3 s on the
small MLP's first epoch here, against a 0.3 s epoch), which a reused worker paid in an earlier job. The
loop samples/s the bench reports leave the launch out under either.

Not a package: bench/ is on sys.path (the benches run as scripts; the tests load it by path).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# How long a job's tasks may run, and how long a task waits for its peers at an allGather.
JOB_TIMEOUT_S = 1800.0
GATHER_TIMEOUT_S = 120.0
_POLL_S = 0.002


def add_launcher_options(parser) -> None:
    """The benches' --launcher/--shards (scaling_bench.py, step_profile_bench.py)."""
    parser.add_argument("--launcher", choices=["spark", "processes"], default="spark",
                        help="processes: each barrier task in a task process of its own, no Spark (needs --shards)")
    parser.add_argument("--shards", help="--launcher processes: a set written by scaling_bench.py --write-shards")


def check_launcher_options(parser, args) -> None:
    if args.launcher == "processes" and not args.shards:
        parser.error("--launcher processes needs --shards DIR (scaling_bench.py --write-shards DIR where Spark runs)")


class TaskProcessError(RuntimeError):
    """A task process failed or died without a result (the stand-in's "Spark job failed")."""


class _Conf:
    def __init__(self, values: dict):
        self._values = values

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        return self._values.get(key, default)


class _Worker:
    """One task process, reused job after job (job: a line on its stdin; answer: a line on its stdout)."""

    def __init__(self, index: int, folder: str):
        path = os.pathsep.join(p for p in (str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        self.stderr_path = os.path.join(folder, f"worker-{index}.stderr")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", "import _process_barrier as b; b._worker_main()"],
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class ProcessBarrierSession:
    """What ``train()`` asks of its session: ``conf.get``, job tags, and ``range(...).mapInArrow(fn, schema,
    barrier=True).collect()``, whose tasks run in task processes here (task r of every job in process r,
    which stays for the next job). ``slots`` only tells the launch code how many tasks fit and that they
    share this host (``local[slots]``)."""

    version = "none (bench/_process_barrier.py: tasks in reused processes)"

    def __init__(self, slots: int, host: str = "127.0.0.1", job_timeout_s: float = JOB_TIMEOUT_S):
        self.conf = _Conf({"spark.master": f"local[{slots}]", "spark.driver.host": host, "spark.task.cpus": "1"})
        self.slots, self.job_timeout_s = slots, job_timeout_s
        self._folder = tempfile.mkdtemp(prefix="shardline-barrier-")
        self._workers: list[Optional[_Worker]] = []
        self._running: dict[str, list[_Worker]] = {}
        self._tags: list[str] = []
        self._jobs = 0

    def addTag(self, tag: str) -> None:  # noqa: N802 - SparkSession's names
        self._tags.append(tag)

    def removeTag(self, tag: str) -> None:  # noqa: N802
        if tag in self._tags:
            self._tags.remove(tag)

    def interruptTag(self, tag: str) -> None:  # noqa: N802
        """As Spark kills a cancelled job's tasks: their processes end (the next job starts new ones)."""
        for worker in self._running.get(tag, []):
            worker.kill()

    def range(self, start: int, end: int, step: int = 1, partitions: Optional[int] = None) -> "_Frame":
        return _Frame(self, len(range(start, end, step)) if partitions is None else partitions)

    def stop(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self._workers = []
        shutil.rmtree(self._folder, ignore_errors=True)

    def workers(self, tasks: int) -> list[_Worker]:
        """Task processes 0..tasks-1: the live ones reused, dead or missing ones started."""
        if tasks > self.slots:
            raise ValueError(f"a barrier job of {tasks} tasks does not fit {self.slots} slots")
        self._workers += [None] * (tasks - len(self._workers))
        for index in range(tasks):
            if self._workers[index] is None or not self._workers[index].alive():
                self._workers[index] = _Worker(index, self._folder)
        return self._workers[:tasks]

    def run_job(self, fn, tasks: int) -> list[dict]:
        import cloudpickle  # the standalone package: a payload of pyspark.cloudpickle would need pyspark

        workers = self.workers(tasks)
        self._jobs += 1
        folder = os.path.join(self._folder, f"job-{self._jobs}")
        os.mkdir(folder, 0o700)
        with open(os.path.join(folder, "task.pkl"), "wb") as f:
            cloudpickle.dump(fn, f)
        tag = self._tags[-1] if self._tags else "untagged"
        self._running[tag] = workers
        try:
            for rank, worker in enumerate(workers):
                worker.proc.stdin.write(json.dumps({"folder": folder, "rank": rank, "tasks": tasks}) + "\n")
                worker.proc.stdin.flush()
            _await_answers(workers, self.job_timeout_s)
            return [row for rank in range(tasks) for row in _read_result(folder, rank)]
        except BaseException:
            for worker in workers:  # a job that did not finish leaves no process mid-task for the next
                worker.kill()
            raise
        finally:
            self._running.pop(tag, None)
            shutil.rmtree(folder, ignore_errors=True)


class _Frame:
    def __init__(self, session: ProcessBarrierSession, tasks: int):
        self.session, self.tasks = session, tasks

    def mapInArrow(self, fn, schema, barrier: bool = False) -> "_Job":  # noqa: N802
        if not barrier:
            raise ValueError("the process stand-in runs barrier stages only")
        return _Job(self.session, fn, self.tasks)


class _Row(dict):
    def asDict(self) -> dict:  # noqa: N802
        return dict(self)


class _Job:
    def __init__(self, session: ProcessBarrierSession, fn, tasks: int):
        self.session, self.fn, self.tasks = session, fn, tasks

    def collect(self) -> list[_Row]:
        return [_Row(r) for r in self.session.run_job(self.fn, self.tasks)]


def _await_answers(workers: list[_Worker], timeout_s: float) -> None:
    """Each worker's answer line ("done"), in any order; the first failure or death raises."""
    import selectors

    deadline = time.monotonic() + timeout_s
    waiting = {worker.proc.stdout.fileno(): (rank, worker) for rank, worker in enumerate(workers)}
    with selectors.DefaultSelector() as selector:
        for fd in waiting:
            selector.register(fd, selectors.EVENT_READ)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TaskProcessError(f"the barrier job's tasks {sorted(r for r, _ in waiting.values())} did not "
                                       f"finish within {timeout_s:.0f}s (ProcessBarrierSession(job_timeout_s=...))")
            for key, _ in selector.select(timeout=min(left, 1.0)):
                rank, worker = waiting.pop(key.fd)
                selector.unregister(key.fd)
                answer = worker.proc.stdout.readline().strip()
                if answer != "done":
                    raise TaskProcessError(f"task process of rank {rank} answered {answer or 'nothing'!r} (exit "
                                           f"{worker.proc.poll()}); its stderr ends:\n{worker.tail()}")


def _read_result(folder: str, rank: int) -> list[dict]:
    import pyarrow as pa

    with pa.OSFile(os.path.join(folder, f"result-{rank}.arrow"), "rb") as f:
        return pa.ipc.open_file(f).read_all().to_pylist()


# -- in a task process ------------------------------------------------------------------------------
class _Context:
    """BarrierTaskContext's calls the task body makes: partitionId, getTaskInfos, resources, allGather,
    barrier. A round: each rank writes gather-<round>-<rank>.json (atomically) and waits for every rank's."""

    def __init__(self, folder: str, rank: int, tasks: int, host: str = "127.0.0.1"):
        self.folder, self.rank, self.tasks, self.host = folder, rank, tasks, host
        self._rounds = 0

    def partitionId(self) -> int:  # noqa: N802
        return self.rank

    def getTaskInfos(self) -> list:  # noqa: N802
        return [SimpleNamespace(address=f"{self.host}:0") for _ in range(self.tasks)]

    def resources(self) -> dict:
        return {}

    def allGather(self, message: str = "") -> list[str]:  # noqa: N802
        self._rounds += 1
        return self.gather(str(self._rounds), message)

    def barrier(self) -> None:
        self.allGather("")

    def gather(self, name: str, message: str) -> list[str]:
        """Every rank's ``message`` of round ``name``, in rank order."""
        mine = os.path.join(self.folder, f"gather-{name}-{self.rank}.json")
        with open(mine + ".tmp", "w") as f:
            json.dump(message, f)
        os.replace(mine + ".tmp", mine)
        paths = [os.path.join(self.folder, f"gather-{name}-{r}.json") for r in range(self.tasks)]
        deadline = time.monotonic() + GATHER_TIMEOUT_S
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
                raise TimeoutError(f"barrier round {name!r}: ranks {missing} did not arrive within "
                                   f"{GATHER_TIMEOUT_S:.0f}s (_process_barrier.GATHER_TIMEOUT_S)")
            time.sleep(_POLL_S)
        out = []
        for p in paths:
            with open(p) as f:
                out.append(json.load(f))
        return out


def _worker_main() -> None:
    """A task process: warm once, then run each job named on stdin, answering "done" or "failed" on stdout."""
    import pickle
    import traceback

    import pyarrow as pa

    answers = os.fdopen(os.dup(1), "w")  # the parent's line; whatever the task prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Warm once, as Spark's reused Python workers are after the benches' warm-up job.
    from _common import warm_process

    warm_process()
    stub = ModuleType("pyspark")  # the task body's `from pyspark import BarrierTaskContext`
    sys.modules["pyspark"] = stub
    for line in sys.stdin:
        job = json.loads(line)
        folder, rank, tasks = job["folder"], job["rank"], job["tasks"]
        try:
            context = _Context(folder, rank, tasks)
            stub.BarrierTaskContext = SimpleNamespace(get=lambda context=context: context)
            with open(os.path.join(folder, "task.pkl"), "rb") as f:
                fn = pickle.load(f)  # our own payload: the parent that started us wrote it in its 0700 folder
            # Spark starts a barrier stage's tasks together; the first synchronous step must not count a
            # peer that is still unpickling.
            context.gather("start", "ready")
            batches = list(fn(iter(())))
            path = os.path.join(folder, f"result-{rank}.arrow")
            with pa.OSFile(path + ".tmp", "wb") as sink:
                writer = pa.ipc.new_file(sink, batches[0].schema)
                for batch in batches:
                    writer.write_batch(batch)
                writer.close()
            os.replace(path + ".tmp", path)
            answer = "done"
        except Exception:  # noqa: BLE001 - the parent raises it, with this process's stderr
            traceback.print_exc()
            sys.stderr.flush()
            answer = "failed"
        print(answer, file=answers, flush=True)
