"""What each training essential costs per step, side by side with the plain step.

    .venv/bin/python bench/train_options_bench.py [--features 64] [--hidden 256 256] [--batch 256]
        [--params 1000000] [--steps 30] [--repeat 5] [--device cpu|cuda] [--threads 1]

No Spark, no sockets: the two places a step's time goes, measured in this process.

  worker step: forward + backward + the local optimizer's step (what an allreduce replica or an
      average-mode worker runs; a sync-mode worker runs the same forward/backward) of an MLP on one
      random batch, for: plain (fp32, constant lr), schedule (warmup + cosine: the LambdaLR set per
      step), clip (clip_grad_norm_ at 1.0), bf16 (autocast), bf16 + clip + schedule, and on CUDA fp16
      (autocast + GradScaler). On CPU fp16 is skipped: refused by train.precision on CPU.
  server step: the parameter server's ``ShardCore.optimizer_step`` (SGD with momentum on a flat
      vector of --params values): plain, schedule, clip (the global norm of the applied gradient).
  guard / early stopping: nothing per step; per epoch the driver copies the PS state when an epoch is
      the best so far (``server.state_dict``), timed here for --params values.

Every figure is a ratio to plain measured in this run (interleaved over --repeat rounds, best round of
each), plus the plain step's own time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKER_OPTIONS = ("plain", "schedule", "clip", "bf16", "bf16+clip+schedule", "fp16")
SERVER_OPTIONS = ("plain", "schedule", "clip")


def _spec(option: str, steps: int):
    from pipeline.ps import OptimizerSpec
    from pipeline.ps.modes.schedule import ScheduleSpec

    schedule = ScheduleSpec(max(steps, 2), warmup_steps=max(steps // 4, 1), decay="cosine") \
        if "schedule" in option else None
    return OptimizerSpec("sgd", lr=0.01, momentum=0.9, schedule=schedule,
                         clip_grad_norm=1.0 if "clip" in option else None)


def worker_stepper(option: str, *, features: int, hidden: list[int], batch: int, steps: int, device: str):
    """A callable running one training step with ``option``, and its warm-up already done."""
    import torch

    from pipeline.worker.precision import LocalOptimizer, Precision

    torch.manual_seed(0)
    layers, width = [], features
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).to(device)
    precision = Precision("bf16" if "bf16" in option else "fp16" if option == "fp16" else "fp32", device)
    optimizer = LocalOptimizer(_spec(option, steps), model.parameters(), precision)
    x = torch.randn(batch, features, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    count = [0]

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        loss.item()  # the loop's one sync per step
        optimizer.step(count[0] % steps)
        count[0] += 1

    for _ in range(3):
        step()
    return step


def server_stepper(option: str, *, params: int, steps: int):
    import torch

    from pipeline.ps import PSSettings
    from pipeline.ps.state.core import ShardCore

    core = ShardCore(torch.zeros(params), PSSettings(optimizer=_spec(option, steps)), generation=1)
    grad = torch.randn(params, generator=torch.Generator().manual_seed(0))
    buffer = torch.empty_like(grad)

    def step() -> None:
        buffer.copy_(grad)  # the pushes' sum, divided by the world size in the step
        core.optimizer_step(buffer, 2)
        core.version = (core.version + 1) % steps

    for _ in range(3):
        step()
    return step, core


def _time(step, steps: int, device: str) -> float:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def measure(steppers: dict, steps: int, repeat: int, device: str = "cpu") -> dict[str, float]:
    """Seconds per step of each stepper: interleaved rounds, best round of each."""
    best = {name: float("inf") for name in steppers}
    for _ in range(repeat):
        for name, step in steppers.items():
            best[name] = min(best[name], _time(step, steps, device))
    return best


def snapshot_seconds(core, repeat: int) -> float:
    import copy

    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        with core.cond:
            copy.deepcopy(core.state_locked())
        best = min(best, time.perf_counter() - started)
    return best


def run(args) -> dict:
    import torch

    device = args.device
    worker_options = [o for o in WORKER_OPTIONS if o != "fp16" or device.startswith("cuda")]
    workers = {o: worker_stepper(o, features=args.features, hidden=args.hidden, batch=args.batch,
                                 steps=args.steps, device=device) for o in worker_options}
    servers = {o: server_stepper(o, params=args.params, steps=args.steps) for o in SERVER_OPTIONS}
    worker_s = measure(workers, args.steps, args.repeat, device)
    server_s = measure({o: s for o, (s, _) in servers.items()}, args.steps, args.repeat)
    return {"device": device, "torch_threads": torch.get_num_threads(),
            "worker_step_s": worker_s, "worker_ratio": {o: worker_s[o] / worker_s["plain"] for o in worker_s},
            "server_step_s": server_s, "server_ratio": {o: server_s[o] / server_s["plain"] for o in server_s},
            "best_epoch_snapshot_s": snapshot_seconds(servers["plain"][1], args.repeat)}


def report(result: dict, args) -> str:
    lines = [f"worker step (MLP {args.features}-{'-'.join(map(str, args.hidden))}-10, batch {args.batch}, "
             f"{result['device']}, {result['torch_threads']} threads): plain "
             f"{result['worker_step_s']['plain'] * 1e3:.3f} ms"]
    lines += [f"  {o:<20} x {r:.2f}" for o, r in result["worker_ratio"].items() if o != "plain"]
    lines.append(f"server step (SGD momentum, {args.params:,} params): plain "
                 f"{result['server_step_s']['plain'] * 1e3:.3f} ms")
    lines += [f"  {o:<20} x {r:.2f}" for o, r in result["server_ratio"].items() if o != "plain"]
    lines.append(f"guard / early stopping: 0 per step; best-epoch snapshot {result['best_epoch_snapshot_s'] * 1e3:.2f} "
                 f"ms per improving epoch ({args.params:,} params)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared "
                                                                 "machine, as a Spark task slot runs)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = run(args)
    print(report(result, args))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
