"""GPipe pipeline bubble and throughput against the ideal, per micro-batch count.

    .venv/bin/python bench/pipeline_bench.py [--micro 1 4 8] [--steps 30] [--warmup 3] [--batch 256]

A 4-stage MLP (256 -> 1024 -> 1024 -> 1024 -> 10, ReLU between, cut by parameter count), each stage in
its own process (multiprocessing spawn, ``torch.set_num_threads(1)``), adjacent stages joined by
authenticated stage links on 127.0.0.1. Each process runs the fill-drain schedule plus its own SGD step
per step. After a warm-up it reports, per micro-batch count M: each stage's bubble fraction
idle / (idle + compute) (idle = blocked in a receive), its compute time per step, and samples/s over the
timed steps, next to the ideal GPipe bubble (P - 1) / (M + P - 1).

Compute and idle are wall-clock times: with fewer cores than stages the processes time-share the CPU,
so compute is stretched and the measured bubble is not the ideal one; the core count is printed.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HOST = "127.0.0.1"
SECRET = b"pipeline-bench"
GENERATION = 1
WIDTHS = (256, 1024, 1024, 1024, 10)
# Equal stages: GPipe's ideal bubble assumes them, the model above cannot have them (its first and last
# layers are 4x and 100x lighter), so its bubble mostly measures imbalance.
BALANCED = (1024, 1024, 1024, 1024, 1024)
STAGES = 4


def _model(widths):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers: list = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _stage(p: int, widths: tuple, args: argparse.Namespace, ports: mp.Queue, next_port: mp.Queue,
           out: mp.Queue) -> None:
    import torch
    import torch.nn.functional as F

    from pipeline.parallel import GPipeStage, StageListener, connect_link, split_stages

    torch.set_num_threads(1)
    module = split_stages(_model(widths), STAGES)[p]
    prev = nxt = listener = None
    try:
        if p > 0:
            listener = StageListener(HOST, SECRET, GENERATION, stage=p, rank=p, expect_rank=p - 1, timeout_s=120)
            ports.put((p, listener.address[1]))
        if p < STAGES - 1:
            nxt = connect_link(HOST, next_port.get(timeout=120), SECRET, GENERATION, stage=p, rank=p,
                               expect_rank=p + 1, timeout_s=120)
        if listener is not None:
            prev = listener.accept()
        gen = torch.Generator().manual_seed(7)
        features = torch.randn(args.batch, widths[0], generator=gen)
        labels = torch.randint(0, widths[-1], (args.batch,), generator=gen)
        opt = torch.optim.SGD(module.parameters(), lr=0.01)
        step = 0
        for micro in args.micro:
            stage = GPipeStage(module, stage=p, stages=STAGES, micro_batches=micro, prev=prev, next=nxt,
                               loss_fn=F.cross_entropy if p == STAGES - 1 else None)
            for timed in (False, True):
                started = time.perf_counter()
                for _ in range(args.steps if timed else args.warmup):
                    opt.zero_grad()
                    stage.step(step, features=features if p == 0 else None,
                               labels=labels if p == STAGES - 1 else None)
                    opt.step()
                    step += 1
                wall = time.perf_counter() - started
                stats = stage.take()
            out.put((micro, p, stats.compute_s, stats.idle_s, stats.send_s, stats.bytes_sent, wall))
    finally:
        for closable in (prev, nxt, listener):
            if closable is not None:
                closable.close()


def _run(widths: tuple, args: argparse.Namespace) -> dict:
    """{(M, stage): (compute_s, idle_s, send_s, bytes_sent, wall_s)} over the timed steps."""
    ctx = mp.get_context("spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    next_ports = [ctx.Queue() for _ in range(STAGES)]
    procs = [ctx.Process(target=_stage, args=(p, widths, args, ports, next_ports[p], out), daemon=True)
             for p in range(STAGES)]
    for proc in procs:
        proc.start()
    for _ in range(STAGES - 1):
        p, port = ports.get(timeout=120)
        next_ports[p - 1].put(port)
    results = {}
    for _ in range(STAGES * len(args.micro)):
        micro, p, compute, idle, send, sent, wall = out.get(timeout=600)
        results[(micro, p)] = (compute, idle, send, sent, wall)
    for proc in procs:
        proc.join(60)
    if any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(f"a stage process failed: exit codes {[proc.exitcode for proc in procs]}")
    return results


def _single_process(widths: tuple, args: argparse.Namespace) -> float:
    """Samples/s of the whole model in this process on one thread: the no-pipeline baseline."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = _model(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(args.batch, widths[0], generator=gen)
    labels = torch.randint(0, widths[-1], (args.batch,), generator=gen)
    for timed in (False, True):
        started = time.perf_counter()
        for _ in range(args.steps if timed else args.warmup):
            opt.zero_grad()
            F.cross_entropy(model(features), labels).backward()
            opt.step()
    return args.steps * args.batch / (time.perf_counter() - started)


def _report(widths: tuple, results: dict, baseline: float, args: argparse.Namespace) -> None:
    from pipeline.models import num_parameters
    from pipeline.parallel import split_stages
    from pipeline.parallel.stages import cut_points

    model = _model(widths)
    sizes = [num_parameters(s) for s in split_stages(model, STAGES)]
    print(f"MLP {' -> '.join(map(str, widths))}: cut at layers {cut_points(model, STAGES)}, parameters per "
          f"stage {sizes}; single process, 1 thread: {baseline:.0f} samples/s")
    print(f"{'M':>3} {'ideal bubble':>12} " + " ".join(f"{'bubble s' + str(p):>9}" for p in range(STAGES))
          + " " + " ".join(f"{'ms/step s' + str(p):>11}" for p in range(STAGES))
          + f" {'samples/s':>10} {'MB sent/step s0':>15}")
    for micro in args.micro:
        ideal = (STAGES - 1) / (micro + STAGES - 1)
        rows = [results[(micro, p)] for p in range(STAGES)]
        bubbles = [idle / (compute + idle) for compute, idle, *_ in rows]
        compute_ms = [r[0] / args.steps * 1e3 for r in rows]
        wall = max(r[4] for r in rows)
        sent_mb = rows[0][3] / args.steps / 2**20
        print(f"{micro:>3} {ideal:>12.3f} " + " ".join(f"{b:>9.3f}" for b in bubbles) + " "
              + " ".join(f"{c:>11.1f}" for c in compute_ms)
              + f" {args.steps * args.batch / wall:>10.0f} {sent_mb:>15.2f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    started = time.perf_counter()
    runs = [(widths, _run(widths, args)) for widths in (WIDTHS, BALANCED)]
    import torch  # after the children: the parent's torch import does not slow their start

    print(f"pipeline_bench: {STAGES} stages, each its own process with 1 torch thread, links on {HOST}; "
          f"batch {args.batch}, {args.steps} timed steps after {args.warmup} warm-up; torch {torch.__version__}")
    print(f"host has {os.cpu_count()} CPU core(s) for {STAGES} stage processes: with fewer cores than stages "
          "the stages time-share the CPU, compute times stretch and the measured bubble is not GPipe's ideal")
    print("bubble = idle / (idle + compute) per stage, idle = time blocked in receives; "
          "ideal = (P - 1) / (M + P - 1) for equal stages")
    print()
    for widths, results in runs:
        _report(widths, results, _single_process(widths, args), args)
    print(f"total bench time {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
