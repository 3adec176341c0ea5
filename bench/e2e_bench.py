"""End to end, head to head: shardline (PS sync, allreduce) vs TorchDistributor vs one torch process.

    .venv/bin/python bench/e2e_bench.py [--rows 200000] [--features 64] [--hidden 128] [--batch-size 256]
        [--epochs 2] [--workdir /tmp/shardline-e2e-bench] [--single-threads 1] [--cold]

One local[2] SparkSession (spark.task.cpus=1) for everything. Not timed: the synthetic data set (N(0,1)
features, labels from a fixed random teacher network) is generated and run through the shard ETL once
(2 train shards), and a warm-up imports torch and shardline's worker modules in the driver and the
Spark Python workers, as any earlier job of a session would have (--cold skips it). Then the same MLP
(same seeded initialization), per-worker batch (global batch = 2 x per-worker), steps per epoch
(`pipeline.shards.steps_per_epoch`), epochs, SGD lr/momentum and shuffle seeds, on the same shards:

  shardline ps         `pipeline.launch.train` with train.backend=ps (if the key exists), ps.mode=sync:
                       2 barrier tasks, gradients averaged and SGD applied on the driver's PS;
  shardline allreduce  the same call with train.backend=allreduce ("n/a" while the schema lacks the key);
  TorchDistributor     `TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(...)`:
                       torchrun inside 2 barrier tasks, gloo DDP, each rank streaming its own shard with
                       `pipeline.data.StreamingLoader`; rank 0 returns its final parameters. Every run
                       starts fresh processes (wrapper, torchrun agent, worker per rank): part of its wall;
  single process       this process, all train rows, batch = global batch, the same loader, torch
                       threads --single-threads (default 1, like each distributed worker: Spark sets
                       OMP_NUM_THREADS=spark.task.cpus; 2 threads on a loaded 2-core box is slower and erratic).

wall s = the training call alone (train(), TorchDistributor.run(), or loader + loop for the single
process); train samples/s = train rows x epochs / wall s; test acc = `pipeline.evaluate.evaluate` on
the test split of the final parameters (the same Spark evaluation for every row, not timed). Prints a
table, the shardline / TorchDistributor ratios of samples/s and wall time, where each launcher's time
went (training loop vs launch overhead; TorchDistributor's rank 0 timeline from /proc process start
times), and the total runtime.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# -- TorchDistributor's training function (pickled by value; runs under torchrun in a Spark task) --------
def _process_start(pid: int | str = "self") -> float | None:
    """Wall-clock start time of a process (Linux /proc), for the launch-overhead breakdown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _parent(pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def td_train(files_by_rank: list[list[str]], row_groups_by_rank: list[list[list[int]]], spec: dict, task: str,
             num_features: int, features_field: str, label_field: str, steps_per_epoch: int, epochs: int,
             seed: int, lr: float, momentum: float, weight_decay: float, loader_opts: dict):
    """One DDP rank: gloo, this rank's train shard through shardline's loader, SGD; rank 0 returns its
    final flat parameters (float32 bytes) and timestamps for the overhead breakdown."""
    entered = time.time()
    # This process (torchrun's worker), its parent (the torchrun agent) and the agent's parent (pyspark's
    # torch_run_process_wrapper, started by the Spark task): when each one started.
    agent = _parent()
    wrapper = _parent(agent) if agent else None
    started = {"wrapper": _process_start(wrapper) if wrapper else None,
               "agent": _process_start(agent) if agent else None, "worker": _process_start()}
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.data import StreamingLoader
    from pipeline.models import ModelSpec, build_model, flat_parameters, loss_fn

    imported = time.time()
    dist.init_process_group("gloo")  # TorchDistributor/torchrun set MASTER_ADDR/PORT, RANK, WORLD_SIZE
    try:
        rank = dist.get_rank()
        initialized = time.time()
        torch.manual_seed(seed)  # the same initialization shardline's driver builds
        model = build_model(ModelSpec.from_dict(spec))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        loss = loss_fn(task)
        loader = StreamingLoader(files_by_rank[rank], steps_per_epoch=steps_per_epoch, seed=seed, rank=rank,
                                 features_field=features_field, label_field=label_field,
                                 num_features=num_features, row_group_rows=row_groups_by_rank[rank], **loader_opts)
        loop_started = time.time()
        samples = 0
        for epoch in range(epochs):
            for x, y in loader.epoch(epoch):
                optimizer.zero_grad(set_to_none=True)
                loss(ddp(x), y).backward()
                optimizer.step()
                samples += len(x)
        finished = time.time()
        if rank != 0:
            return None
        return {"parameters": flat_parameters(model).detach().numpy().astype("float32").tobytes(),
                "samples": samples, "threads": torch.get_num_threads(), "pid": os.getpid(),
                "t": {**started, "entered": entered, "imported": imported, "initialized": initialized,
                      "loop_started": loop_started, "finished": finished}}
    finally:
        dist.destroy_process_group()


WARM_IMPORTS = ("torch", "torch.distributed", "pipeline.data", "pipeline.models", "pipeline.ps",
                "pipeline.checkpoints", "pipeline.launch.task.body", "pipeline.worker.loop")


def _worker_threads(_batches):
    """The Spark Python worker's thread settings, without importing torch."""
    import pyarrow as pa

    for _ in _batches:  # read the input to its end, or Spark does not reuse this worker
        pass
    yield pa.RecordBatch.from_pylist([{"threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
                                       "omp": os.environ.get("OMP_NUM_THREADS", "unset"), "pid": os.getpid()}])


def _worker_env(_batches):
    """Warm-up task: import torch and shardline's worker modules in a Spark Python worker (once per
    session, as any earlier job would have) and report the worker's thread settings."""
    import importlib

    import pyarrow as pa
    import torch

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    for _ in _batches:  # read the input to its end, or Spark does not reuse this worker
        pass

    yield pa.RecordBatch.from_pylist([{"threads": torch.get_num_threads(),
                                       "omp": os.environ.get("OMP_NUM_THREADS", "unset"), "pid": os.getpid()}])


def single_process(manifest, spec, cfg, steps: int, threads: int) -> tuple:
    """All train rows in this process, batch = the global batch, the same number of steps per epoch."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _single_process(manifest, spec, cfg, steps)
    finally:
        torch.set_num_threads(previous)


def _single_process(manifest, spec, cfg, steps: int) -> tuple:
    import torch

    from pipeline.data import StreamingLoader
    from pipeline.models import build_model, flat_parameters, loss_fn

    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    loss = loss_fn(manifest.task)
    loader = StreamingLoader(manifest.files("train"), steps_per_epoch=steps, seed=t.seed, rank=0,
                             features_field=manifest.features_field, label_field=manifest.label_field,
                             num_features=manifest.num_features, row_group_rows=manifest.row_group_rows("train"),
                             **_loader_opts(cfg))
    samples = 0
    for epoch in range(t.epochs):
        for x, y in loader.epoch(epoch):
            optimizer.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
            optimizer.step()
            samples += len(x)
    return flat_parameters(model).detach(), samples


def _td_timeline(called: float, t: dict, returned: float) -> str:
    """Rank 0's TorchDistributor run as consecutive phases (seconds), from the driver's call to its return."""
    marks = [("Spark barrier job -> task starts torchrun wrapper", t.get("wrapper")),
             ("wrapper -> torchrun agent", t.get("agent")),
             ("agent (imports torch, rendezvous) -> worker process", t.get("worker")),
             ("worker: python + unpickle train_fn", t["entered"]),
             ("imports (torch, pipeline)", t["imported"]),
             ("gloo init", t["initialized"]),
             ("DDP setup (waits for the other rank) + loader", t["loop_started"]),
             ("training loop", t["finished"]),
             ("return: exits, result file, Spark collect", returned)]
    parts, last = [], called
    for label, mark in marks:
        if mark is None:
            continue
        parts.append(f"{mark - last:.1f}s {label}")
        last = mark
    return "; ".join(parts)


def _loader_opts(cfg) -> dict:
    d = cfg.data
    return {"shuffle": d.shuffle, "shuffle_buffer_rows": d.shuffle_buffer_rows, "reader_threads": d.reader_threads,
            "reader": d.reader, "prefetch": cfg.train.prefetch}


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128])
    parser.add_argument("--batch-size", type=int, default=256, help="per worker; global = 2x")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/shardline-e2e-bench")
    parser.add_argument("--single-threads", type=int, default=1,
                        help="torch threads of the single-process row (each distributed worker runs 1: Spark "
                             "sets OMP_NUM_THREADS=spark.task.cpus)")
    parser.add_argument("--cold", action="store_true",
                        help="skip the untimed warm-up (torch + shardline imports in the driver and the Spark "
                             "Python workers): shardline's first train() then pays them")
    args = parser.parse_args()
    total_started = time.perf_counter()
    workers = 2

    import numpy as np

    from pipeline.config import load
    from pipeline.config.schema import TrainConfig
    from pipeline.errors import ConfigError
    from pipeline.etl import run_etl
    from pipeline.etl.synthetic import generate
    from pipeline.evaluate import evaluate
    from pipeline.launch import train
    from pipeline.models import model_spec
    from pipeline.session import get_or_create_spark
    from pipeline.shards import steps_per_epoch

    base = [f"workdir={args.workdir}", "name=e2ebench", f"data.synthetic.rows={args.rows}",
            f"data.synthetic.features={args.features}", f"parallelism.data={workers}", "spark.master=local[2]",
            f"model.hidden={list(args.hidden)}", f"train.batch_size={args.batch_size}", f"train.epochs={args.epochs}",
            "ps.mode=sync", "tracking.log_model=false"]
    conf_path = str(REPO / "conf" / "synthetic.yaml")
    cfg = load(conf_path, base)
    # One task per core, so the 2 barrier tasks (shardline's and TorchDistributor's) fit in local[2].
    spark_cfg = cfg.spark.model_copy(update={"conf": {**cfg.spark.conf, "spark.task.cpus": "1"}})
    spark = get_or_create_spark(spark_cfg)

    prep_started = time.perf_counter()
    generate(spark, cfg.data, cfg.workdir)
    manifest = run_etl(spark, cfg)
    # Spark hands tasks the oldest idle Python worker first and the ETL may have left more than 2, so the
    # warm-up repeats until a job lands only on workers it already warmed.
    warmed: set[int] = set()
    for _ in range(8):
        env = spark.range(0, workers, 1, workers).mapInArrow(
            _worker_env if not args.cold else _worker_threads, "threads long, omp string, pid long").collect()
        pids = {r["pid"] for r in env}
        if args.cold or pids <= warmed:
            break
        warmed |= pids
    if not args.cold:
        import importlib

        for name in WARM_IMPORTS:  # the driver side of a session that has trained before
            importlib.import_module(name)
    prep_s = time.perf_counter() - prep_started
    train_rows = manifest.split("train").rows
    steps = steps_per_epoch(manifest, workers, cfg.train.batch_size)
    spec = model_spec(cfg.model, features=manifest.feature_set, num_classes=manifest.num_classes,
                      task=manifest.task)
    expected_samples = train_rows * cfg.train.epochs

    def accuracy(parameters) -> float:
        return evaluate(spark, manifest, spec, parameters, "test").metrics["accuracy"]

    rows: list[dict] = []
    notes: list[str] = []
    failed = False
    has_backend = "backend" in TrainConfig.model_fields

    def shardline_row(label: str, backend: str) -> None:
        nonlocal failed
        overrides = base + ([f"train.backend={backend}"] if has_backend else [])
        if not has_backend and backend != "ps":
            rows.append({"backend": label, "wall": "n/a", "rate": "n/a", "acc": "n/a (train.backend not available)"})
            return
        try:
            row_cfg = load(conf_path, overrides)
        except ConfigError as exc:
            rows.append({"backend": label, "wall": "n/a", "rate": "n/a",
                         "acc": f"n/a (train.backend={backend} rejected: {str(exc).splitlines()[-1].strip()})"})
            return
        try:
            started = time.perf_counter()
            result = train(spark, row_cfg, manifest)
            wall = time.perf_counter() - started
            samples = sum(r["samples"] for r in result.ranks)
            if samples != expected_samples:
                notes.append(f"{label}: trained {samples} samples, expected {expected_samples}")
            loop = max(r["seconds"] for r in result.ranks)
            notes.append(f"{label}: {result.steps} steps; slowest worker run() {loop:.1f}s of {wall:.1f}s wall "
                         f"(PS/driver setup, barrier stage launch, teardown: {wall - loop:.1f}s); ranks in Python "
                         f"workers {[r['process'] for r in result.ranks]}")
            rows.append({"backend": label, "wall": wall, "rate": expected_samples / wall,
                         "acc": accuracy(result.parameters)})
        except Exception as exc:
            failed = True
            traceback.print_exc()
            rows.append({"backend": label, "wall": "error", "rate": "error",
                         "acc": f"{type(exc).__name__}: {exc}"[:200]})

    shardline_row("shardline ps (sync)", "ps")
    shardline_row("shardline allreduce", "allreduce")

    # TorchDistributor -------------------------------------------------------------------------------
    try:
        from pyspark.ml.torch.distributor import TorchDistributor

        t = cfg.train
        td_args = ([manifest.files("train", r) for r in range(workers)],
                   [manifest.row_group_rows("train", r) for r in range(workers)], spec.to_dict(), manifest.task,
                   manifest.num_features, manifest.features_field, manifest.label_field, steps, t.epochs, t.seed,
                   t.lr, t.momentum, t.weight_decay, _loader_opts(cfg))
        started = time.perf_counter()
        called = time.time()
        out = TorchDistributor(num_processes=workers, local_mode=False, use_gpu=False).run(td_train, *td_args)
        returned = time.time()
        wall = time.perf_counter() - started
        import torch

        parameters = torch.from_numpy(np.frombuffer(out["parameters"], dtype=np.float32).copy())
        if out["samples"] * workers < expected_samples - workers:
            notes.append(f"TorchDistributor: rank 0 trained {out['samples']} samples")
        notes.append(f"TorchDistributor: {wall:.1f}s wall, torch threads per rank {out['threads']}; rank 0's "
                     f"timeline: {_td_timeline(called, out['t'], returned)}")
        rows.append({"backend": "TorchDistributor (DDP gloo)", "wall": wall, "rate": expected_samples / wall,
                     "acc": accuracy(parameters)})
    except Exception as exc:
        failed = True
        traceback.print_exc()
        rows.append({"backend": "TorchDistributor (DDP gloo)", "wall": "error", "rate": "error",
                     "acc": f"{type(exc).__name__}: {exc}"[:200]})

    # Single process ---------------------------------------------------------------------------------
    import torch

    started = time.perf_counter()
    parameters, samples = single_process(manifest, spec, cfg, steps, args.single_threads)
    wall = time.perf_counter() - started
    rows.append({"backend": "single-process torch", "wall": wall, "rate": expected_samples / wall,
                 "acc": accuracy(parameters)})
    notes.append(f"single-process torch: {samples} samples, batch ~{samples // (steps * cfg.train.epochs)}, "
                 f"torch threads {args.single_threads}")

    # Report -----------------------------------------------------------------------------------------
    print()
    print(f"data: {args.rows} rows x {args.features} features, {manifest.num_classes} classes; train "
          f"{train_rows}, test {manifest.split('test').rows} rows; generate + ETL + warm-up {prep_s:.1f}s, not timed")
    print(f"model: MLP {args.features}-{'-'.join(map(str, args.hidden))}-{manifest.num_classes}; {workers} workers x "
          f"batch {cfg.train.batch_size} (global {workers * cfg.train.batch_size}), {steps} steps/epoch x "
          f"{cfg.train.epochs} epochs, SGD lr {cfg.train.lr} momentum {cfg.train.momentum}")
    print(f"host: {os.cpu_count()} cpus, spark {spark.version} {spark.conf.get('spark.master')}, torch "
          f"{torch.__version__}; Spark Python workers: torch threads {[r['threads'] for r in env]}, "
          f"OMP_NUM_THREADS {[r['omp'] for r in env]}"
          + (f"; warm-up reached Python workers {sorted(warmed)}" if warmed else "; --cold: no warm-up"))
    print()
    width = max(len(r["backend"]) for r in rows)
    print(f"{'backend':<{width}} | {'wall s':>7} | {'train samples/s':>15} | test acc")
    print(f"{'-' * width}-|-{'-' * 7}-|-{'-' * 15}-|-{'-' * 8}")
    for r in rows:
        print(f"{r['backend']:<{width}} | {_fmt(r['wall'], '7.1f'):>7} | {_fmt(r['rate'], '15,.0f'):>15} | "
              f"{_fmt(r['acc'], '.4f')}")
    print()
    by_name = {r["backend"]: r for r in rows}
    td = by_name["TorchDistributor (DDP gloo)"]
    for name, label in (("shardline ps (sync)", "shardline ps"), ("shardline allreduce", "shardline allreduce")):
        r = by_name[name]
        if all(isinstance(v, float) for v in (r["rate"], td["rate"])):
            print(f"{label} / TorchDistributor: samples/s {r['rate'] / td['rate']:.2f}x, "
                  f"wall time {r['wall'] / td['wall']:.2f}x")
        else:
            print(f"{label} / TorchDistributor: n/a")
    print()
    for note in notes:
        print(f"  {note}")
    print(f"\ntotal runtime: {time.perf_counter() - total_started:.1f}s")
    spark.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
