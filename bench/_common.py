"""What the end-to-end benches share (bench/e2e_bench.py, bench/scaling_bench.py, bench/step_profile_bench.py):
the synthetic data set through the shard ETL (or a written set regrouped into N shards), the untimed
warm-up of the Spark Python workers, a shardline train() row with its loop time and CPU seconds, the
one-process trainer and N of them at once as separate processes (the machine's limit).

Not a package: the benches run as scripts (their folder is on sys.path) and the tests load them by path
with bench/ on sys.path (tests/bench/conftest.py).

Why CPU seconds beside wall seconds: the benches run on shared boxes where wall time swings with other
load; the CPU a run spent on its steps (every thread of its processes) moves much less.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CONF = REPO / "conf" / "synthetic.yaml"

# What an earlier job of the session would have imported in the driver and the Spark Python workers.
WARM_IMPORTS = ("torch", "torch.distributed", "pipeline.data", "pipeline.models", "pipeline.ps",
                "pipeline.checkpoints", "pipeline.launch.task.body", "pipeline.worker.loop")


def fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def base_overrides(workdir: str, name: str, rows: int, features: int, hidden, batch_size: int, epochs: int,
                   workers: int, master: str) -> list[str]:
    return [f"workdir={workdir}", f"name={name}", f"data.synthetic.rows={rows}", f"data.synthetic.features={features}",
            f"parallelism.data={workers}", f"spark.master={master}", f"model.hidden={list(hidden)}",
            f"train.batch_size={batch_size}", f"train.epochs={epochs}", "ps.mode=sync", "tracking.log_model=false"]


def spark_session(cfg):
    """One task per core (spark.task.cpus=1), so N barrier tasks fit in local[N]."""
    from pipeline.session import get_or_create_spark

    return get_or_create_spark(cfg.spark.model_copy(update={"conf": {**cfg.spark.conf, "spark.task.cpus": "1"}}))


def prepare_data(spark, cfg):
    """The synthetic data set and its shards (parallelism.data of them): the manifest."""
    from pipeline.etl import run_etl
    from pipeline.etl.synthetic import generate

    generate(spark, cfg.data, cfg.workdir)
    return run_etl(spark, cfg)


def regroup(manifest, n: int):
    """``manifest`` with its train split's S shards merged into n shards of S/n consecutive source shards
    (files and rows unchanged), the other splits as they are: an n-worker shard set of the same rows."""
    import dataclasses

    from pipeline.shards.manifest import Shard, SplitShards

    train = manifest.split("train")
    per, left = divmod(len(train.shards), n)
    if left or not per:
        raise ValueError(f"the shard set at {manifest.root} has {len(train.shards)} train shards, which cannot be "
                         f"regrouped into {n}: write it for a multiple of every worker count (--write-shards with "
                         f"--workers {n * max(per, 1)})")
    shards = tuple(Shard(i, sum(s.rows for s in group), tuple(f for s in group for f in s.files))
                   for i, group in enumerate(train.shards[j * per:(j + 1) * per] for j in range(n)))
    return dataclasses.replace(manifest, splits={**manifest.splits, "train": SplitShards(train.rows, shards)})


def _worker_threads(_batches):
    """The Spark Python worker's thread settings, without importing torch."""
    import pyarrow as pa

    for _ in _batches:  # read the input to its end, or Spark does not reuse this worker
        pass
    yield pa.RecordBatch.from_pylist([{"threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
                                       "omp": os.environ.get("OMP_NUM_THREADS", "unset"), "pid": os.getpid()}])


def warm_process() -> None:
    """This process as an earlier job of the session would have left a task's Python worker: torch and
    shardline's worker modules imported, torch's first optimizer built."""
    import importlib

    import torch

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    # A worker that trained with a local optimizer before (allreduce, ps.mode=average) has imported
    # torch._dynamo, which the first torch.optim construction in a process does (seconds).
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _worker_env(_batches):
    """Warm-up task: warm a Spark Python worker (once per session, as any earlier job would have) and
    report the worker's thread settings."""
    import pyarrow as pa
    import torch

    warm_process()
    for _ in _batches:  # read the input to its end, or Spark does not reuse this worker
        pass
    yield pa.RecordBatch.from_pylist([{"threads": torch.get_num_threads(),
                                       "omp": os.environ.get("OMP_NUM_THREADS", "unset"), "pid": os.getpid()}])


def warm_up(spark, tasks: int, cold: bool) -> tuple[list, set[int]]:
    """(the workers' thread settings, the Python worker pids warmed). Spark hands tasks the oldest idle
    Python worker first and the ETL may have left more than ``tasks``, so the warm-up repeats until a job
    lands only on workers it already warmed. Then the driver side too (unless ``cold``)."""
    from pyspark import cloudpickle

    # The Python workers cannot import this module (bench/ is not on their path): ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    warmed: set[int] = set()
    env: list = []
    for _ in range(8):
        env = spark.range(0, tasks, 1, tasks).mapInArrow(
            _worker_env if not cold else _worker_threads, "threads long, omp string, pid long").collect()
        pids = {r["pid"] for r in env}
        if cold or pids <= warmed:
            break
        warmed |= pids
    if not cold:
        import importlib

        for name in WARM_IMPORTS:
            importlib.import_module(name)
    return env, warmed


def loader_opts(cfg) -> dict:
    d = cfg.data
    return {"shuffle": d.shuffle, "shuffle_buffer_rows": d.shuffle_buffer_rows, "reader_threads": d.reader_threads,
            "reader": d.reader, "prefetch": cfg.train.prefetch}


# -- a shardline run ---------------------------------------------------------------------------------
@dataclass
class ShardlineRun:
    wall_s: float  # the train() call
    run_s: float  # the slowest worker's run() (setup inside the task included)
    loop_s: float  # the epochs' own clock, summed (the slowest rank of each epoch)
    cpu_s: float  # CPU seconds of the epochs, summed over ranks (0.0 where the loop does not report them)
    samples: int
    steps: int
    result: object = field(repr=False, default=None)

    @property
    def rate(self) -> float:
        """Loop samples/s: the samples over the epochs' own clock."""
        return self.samples / max(self.loop_s, 1e-9)


def shardline_run(spark, cfg, manifest) -> ShardlineRun:
    from pipeline.launch import train

    started = time.perf_counter()
    result = train(spark, cfg, manifest)
    wall = time.perf_counter() - started
    loop = sum(row["epoch_seconds"] for row in result.history)
    cpu = sum(v for row in result.history for k, v in row.items() if k.endswith("/cpu_s"))
    return ShardlineRun(wall_s=wall, run_s=max(r["seconds"] for r in result.ranks), loop_s=loop, cpu_s=cpu,
                        samples=sum(r["samples"] for r in result.ranks), steps=result.steps, result=result)


# -- one process, and N at once ----------------------------------------------------------------------
def train_one_process(files, row_group_rows, spec_dict: dict, task: str, fields: tuple[str, str], num_features: int,
                      steps: int, epochs: int, seed: int, sgd: tuple[float, float, float], loader: dict,
                      stop_after: Optional[int] = None, step_s: Optional[list] = None):
    """Plain torch: this process's loader over ``files``, SGD, ``steps`` batches per epoch. Returns
    (model, samples, loop seconds, loop CPU seconds); the loop clock starts after every setup.
    ``stop_after``: only that many batches (a warm-up). ``step_s``: a list that gets each step's seconds
    (its batch's wait included), in order."""
    import torch

    from pipeline.data import StreamingLoader
    from pipeline.models import ModelSpec, build_model, loss_fn

    torch.manual_seed(seed)  # the same initialization shardline's driver builds
    model = build_model(ModelSpec.from_dict(spec_dict))
    lr, momentum, weight_decay = sgd
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    loss = loss_fn(task)
    data = StreamingLoader(files, steps_per_epoch=steps, seed=seed, rank=0, features_field=fields[0],
                           label_field=fields[1], num_features=num_features, row_group_rows=row_group_rows, **loader)
    started, cpu = time.perf_counter(), time.process_time()
    samples = batches = 0
    last = started
    for epoch in range(epochs):
        for x, y in data.epoch(epoch):
            optimizer.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
            optimizer.step()
            samples += len(y)  # not len(x): features may be a structure of several tensors
            batches += 1
            if step_s is not None:
                now = time.perf_counter()
                step_s.append(now - last)
                last = now
            if batches == stop_after:
                return model, samples, time.perf_counter() - started, time.process_time() - cpu
    return model, samples, time.perf_counter() - started, time.process_time() - cpu


def trainer_args(manifest, spec, cfg, steps: int, shard: Optional[int]) -> dict:
    """The plain values ``train_one_process`` takes, for one shard of the manifest (None: every train row)."""
    t = cfg.train
    return {"files": manifest.files("train", shard), "row_group_rows": manifest.row_group_rows("train", shard),
            "spec_dict": spec.to_dict(), "task": manifest.task,
            "fields": [manifest.features_field, manifest.label_field], "num_features": manifest.num_features,
            "steps": steps, "epochs": t.epochs, "seed": t.seed, "sgd": [t.lr, t.momentum, t.weight_decay],
            "loader": loader_opts(cfg)}


@dataclass
class Limit:
    """N one-process trainers at once: samples/s together over the span from the first start to the last end."""

    processes: int
    samples: int
    span_s: float
    cpu_s: float  # summed over the processes
    loop_s: list[float]
    step_s: list[list[float]] = field(default_factory=list)  # per process, each step's seconds in order

    @property
    def rate(self) -> float:
        return self.samples / max(self.span_s, 1e-9)

    @property
    def lockstep(self) -> Optional[float]:
        """What fraction of this rate N ranks in lockstep could keep on the same per-step times: the sum
        of each step's mean over the processes ÷ the sum of each step's slowest (the i-th steps of the
        processes paired). A synchronous backend (sync PS, allreduce) waits for the slowest rank at
        every step, so on a box whose step times jitter it stays below the limit by this much even with
        free communication. It pairs steps that ran independently, so it estimates, not measures, that
        cost. None for one process or without step times."""
        if len(self.step_s) < 2 or not all(self.step_s):
            return None
        steps = list(zip(*self.step_s))  # up to the shortest process's steps
        slowest = sum(max(times) for times in steps)
        return sum(sum(times) / len(times) for times in steps) / slowest if slowest > 0 else None


def independent_trainers(args_by_process: list[dict], threads: int = 1, timeout_s: float = 1800.0) -> Limit:
    """Each ``train_one_process`` in its own Python process (torch threads ``threads``, like a Spark task
    with spark.task.cpus=1), all set up first and released together, so the span is training only."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    code = ("import sys; sys.path.insert(0, %r); import _common; _common._trainer_main(%d)"
            % (str(Path(__file__).resolve().parent), threads))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                              text=True) for _ in args_by_process]
    try:
        for proc, args in zip(procs, args_by_process):
            proc.stdin.write(json.dumps(args) + "\n")
            proc.stdin.flush()
        for proc in procs:
            line = proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"an independent trainer failed to set up (exit {proc.wait()}): {line!r}")
        for proc in procs:  # released together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = [json.loads(proc.communicate(timeout=timeout_s)[0].strip().splitlines()[-1]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return Limit(processes=len(procs), samples=sum(o["samples"] for o in outs),
                 span_s=max(o["end"] for o in outs) - min(o["start"] for o in outs),
                 cpu_s=sum(o["cpu"] for o in outs), loop_s=[o["loop"] for o in outs],
                 step_s=[o["step_s"] for o in outs])


def _trainer_main(threads: int) -> None:
    """In an independent trainer's process: set up (imports, model, optimizer, loader: all before
    'ready'), wait for 'go', train, print the timings as one JSON line."""
    import torch

    torch.set_num_threads(threads)
    args = json.loads(sys.stdin.readline())
    # Two throwaway steps first, as warm as the Spark Python workers: imports (torch._dynamo with the first
    # optimizer: seconds), the loader's first reads, torch's first kernels.
    train_one_process(**{**args, "epochs": 1, "stop_after": 2})
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    step_s: list[float] = []
    _, samples, loop, cpu = train_one_process(**args, step_s=step_s)
    end = time.time()  # the loop's start is end - loop: the model and loader setup stay out of the span
    print(json.dumps({"samples": samples, "start": end - loop, "end": end, "loop": loop, "cpu": cpu,
                      "step_s": step_s}), flush=True)
