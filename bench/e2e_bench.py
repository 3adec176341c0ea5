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
table, the shardline / TorchDistributor ratios of samples/s and wall time, each training loop against
TorchDistributor's (wall: the epochs' own clocks vs its loop's; CPU seconds of the loop over the ranks,
TorchDistributor's as rank 0's x 2; the ps rows' CPU leaves out the driver's parameter server), where
each launcher's time went (training loop vs launch overhead; TorchDistributor's rank 0 timeline from
/proc process start times), and the total runtime. The data, warm-up and one-process pieces are
bench/_common.py's, shared with bench/scaling_bench.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (CONF, REPO, base_overrides, fmt, loader_opts, prepare_data, shardline_run,  # noqa: E402
                     spark_session, train_one_process, trainer_args, warm_up)


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
        loop_started, loop_cpu = time.time(), time.process_time()
        samples = 0
        for epoch in range(epochs):
            for x, y in loader.epoch(epoch):
                optimizer.zero_grad(set_to_none=True)
                loss(ddp(x), y).backward()
                optimizer.step()
                samples += len(y)  # not len(x): features may be a structure of several tensors
        finished, cpu = time.time(), time.process_time() - loop_cpu
        if rank != 0:
            return None
        return {"parameters": flat_parameters(model).detach().numpy().astype("float32").tobytes(),
                "samples": samples, "threads": torch.get_num_threads(), "pid": os.getpid(), "cpu": cpu,
                "t": {**started, "entered": entered, "imported": imported, "initialized": initialized,
                      "loop_started": loop_started, "finished": finished}}
    finally:
        dist.destroy_process_group()


def single_process(manifest, spec, cfg, steps: int, threads: int) -> tuple:
    """All train rows in this process, batch = the global batch, the same number of steps per epoch:
    (flat parameters, samples, loop seconds, loop CPU seconds)."""
    import torch

    from pipeline.models import flat_parameters

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, samples, loop, cpu = train_one_process(**trainer_args(manifest, spec, cfg, steps, None))
        return flat_parameters(model).detach(), samples, loop, cpu
    finally:
        torch.set_num_threads(previous)


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
    from pipeline.evaluate import evaluate
    from pipeline.models import model_spec
    from pipeline.shards import steps_per_epoch

    base = base_overrides(args.workdir, "e2ebench", args.rows, args.features, args.hidden, args.batch_size,
                          args.epochs, workers, "local[2]")
    conf_path = str(CONF)
    cfg = load(conf_path, base)
    spark = spark_session(cfg)  # one task per core: the 2 barrier tasks (shardline's, TorchDistributor's) fit

    prep_started = time.perf_counter()
    manifest = prepare_data(spark, cfg)
    env, warmed = warm_up(spark, workers, args.cold)
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
    loops: dict[str, tuple[float, float]] = {}  # training loop: (wall s, CPU s over the ranks)
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
            run = shardline_run(spark, row_cfg, manifest)
            wall, result = run.wall_s, run.result
            if run.samples != expected_samples:
                notes.append(f"{label}: trained {run.samples} samples, expected {expected_samples}")
            # (bench/compare.py parses this note: keep its wording)
            notes.append(f"{label}: {run.steps} steps; slowest worker run() {run.run_s:.1f}s of {wall:.1f}s wall "
                         f"(PS/driver setup, barrier stage launch, teardown: {wall - run.run_s:.1f}s); ranks in Python "
                         f"workers {[r['process'] for r in result.ranks]}")
            notes.append(f"{label}: training loop {run.loop_s:.1f}s (the epochs' own clocks), {run.cpu_s:.1f} CPU s "
                         f"over the ranks")
            loops[label] = (run.loop_s, run.cpu_s)
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
                   t.lr, t.momentum, t.weight_decay, loader_opts(cfg))
        started = time.perf_counter()
        called = time.time()
        out = TorchDistributor(num_processes=workers, local_mode=False, use_gpu=False).run(td_train, *td_args)
        returned = time.time()
        wall = time.perf_counter() - started
        import torch

        parameters = torch.from_numpy(np.frombuffer(out["parameters"], dtype=np.float32).copy())
        if out["samples"] * workers < expected_samples - workers:
            notes.append(f"TorchDistributor: rank 0 trained {out['samples']} samples")
        td_loop = out["t"]["finished"] - out["t"]["loop_started"]
        loops["TorchDistributor"] = (td_loop, out["cpu"] * workers)
        notes.append(f"TorchDistributor: {wall:.1f}s wall, training loop {td_loop:.1f}s ({out['cpu'] * workers:.1f} CPU s: "
                     f"rank 0's x {workers}), torch threads per rank {out['threads']}; rank 0's timeline: "
                     f"{_td_timeline(called, out['t'], returned)}")
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
    parameters, samples, _, _ = single_process(manifest, spec, cfg, steps, args.single_threads)
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
        print(f"{r['backend']:<{width}} | {fmt(r['wall'], '7.1f'):>7} | {fmt(r['rate'], '15,.0f'):>15} | "
              f"{fmt(r['acc'], '.4f')}")
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
    td_loop = loops.get("TorchDistributor")
    for label in ("shardline ps (sync)", "shardline allreduce"):
        if label in loops and td_loop:
            print(f"{label} training loop / TorchDistributor's: wall {loops[label][0] / td_loop[0]:.2f}x, "
                  f"CPU {loops[label][1] / max(td_loop[1], 1e-9):.2f}x")
    print()
    for note in notes:
        print(f"  {note}")
    print(f"\ntotal runtime: {time.perf_counter() - total_started:.1f}s")
    spark.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
