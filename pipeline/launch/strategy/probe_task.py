"""In each probe task (executors): one timed forward/backward on a real batch, the local costs a step adds
(optimizer step, top-k, half-precision cast, a memory copy), and, in the first task of each host, the
link probe. Every task computes at the same time (a barrier stage), so the figure includes what ranks
sharing a host's cores cost each other. Never raises: a failure is a row with its error."""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

RESULT_DDL = ("rank int, host string, kernel string, cores int, hosts int, ranks_per_host int, compute_s double, data_s double, "
              "optimizer_s double, topk_s_per_byte double, cast_s_per_byte double, copy_Bps double, task_s double, "
              "link_s double, error string")
SPELLS, SPELL_GAP_S = 3, 0.05
COMPUTE_BUDGET_S = 0.2  # timed steps of the forward/backward past the minimum, at most this long


@dataclass(frozen=True)
class ProbeWiring:
    """Plain values the probe tasks need (shipped in the closure: no SparkSession, no self)."""

    spec: Any                      # pipeline.models.ModelSpec
    batch_size: int
    files: tuple[str, ...]         # the train split's shard files (the batch is read from the first)
    fields: tuple                  # (features_field, label_field, num_features, feature set): the loader's reader
    server: tuple[str, int]        # the driver's LinkProbeServer
    secret: bytes
    timeout_s: float
    topk_ratio: float
    repeats: int = 3


def typical_s(fn: Callable[[], Any], repeats: int, budget_s: float = 0.0, most: int = 30) -> float:
    """The lower quartile of at least ``repeats`` timed calls after a warm one, more while ``budget_s`` lasts
    (up to ``most``). Not the mean or the minimum: a sibling task still starting up (its imports, its model)
    or a moment of a noisy machine slows some calls, and what every call pays is what a step pays."""
    fn()  # warm: first-call allocations and kernel choices are not a step's cost
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or (len(times) < most and time.perf_counter() - started < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 4]


def best_of_spells(fn: Callable[[], Any], repeats: int, budget_s: float = 0.0) -> float:
    """The best of SPELLS ``typical_s`` spells SPELL_GAP_S apart: a burst of other work on the machine (a JVM
    compiling after the ETL, a sibling task's imports) spoils a spell, and what every spell pays is what a
    step pays."""
    best = typical_s(fn, repeats, budget_s / SPELLS)
    for _ in range(SPELLS - 1):
        time.sleep(SPELL_GAP_S)
        best = min(best, typical_s(fn, repeats, budget_s / SPELLS))
    return best


def read_batch(files, fields, batch_size: int):
    """(inputs, labels, seconds a batch's rows take to read): the first row group of the train split, read
    and decoded by the training loader's reader, its second (warm: imports and the file's metadata are not a
    batch's cost) read's time scaled to ``batch_size`` rows."""
    from pipeline.data.loader import row_groups

    def first():
        for inputs, labels in row_groups(list(files)[:1], *fields):
            return inputs, labels
        raise ValueError(f"the first train shard file {list(files)[:1]} has no rows to time a step on")

    first()
    started = time.perf_counter()
    inputs, labels = first()
    seconds = time.perf_counter() - started
    return ({k: v[:batch_size] for k, v in inputs.items()}, labels[:batch_size],
            seconds * min(batch_size, len(labels)) / max(len(labels), 1))


def local_costs(model, inputs, labels, loss, *, topk_ratio: float, repeats: int,
                budget_s: float = 0.0) -> dict[str, float]:
    """Seconds of forward + backward, of one optimizer step, and the per-byte costs of top-k, a cast and a copy."""
    import torch

    def step():
        model.zero_grad(set_to_none=True)
        loss(model(inputs), labels).backward()

    compute = best_of_spells(step, repeats, budget_s)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-9, momentum=0.9)
    optimizer_s = typical_s(optimizer.step, repeats)
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]) if params else torch.zeros(1)
    return {"compute_s": compute, "optimizer_s": optimizer_s, **flat_costs(flat, topk_ratio, repeats)}


def flat_costs(flat, topk_ratio: float, repeats: int) -> dict[str, float]:
    """Per-byte costs of a gradient ``flat`` (fp32): its top-k selection, a half-precision cast, a copy."""
    import torch

    nbytes = max(flat.numel() * 4, 1)
    keep = max(1, int(flat.numel() * topk_ratio))
    target = torch.empty_like(flat)
    return {"topk_s_per_byte": typical_s(lambda: torch.topk(flat.abs(), keep, sorted=False), repeats) / nbytes,
            "cast_s_per_byte": typical_s(lambda: flat.to(torch.float16), repeats) / nbytes,
            "copy_Bps": nbytes / typical_s(lambda: target.copy_(flat), repeats)}


def kernel_id() -> str:
    """The running kernel's boot id: equal in two processes exactly when they share a machine's CPUs (network
    namespaces and containers included), which no address tells."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cores() -> int:
    """The CPUs this process may run on (its affinity, which a container or Spark's cgroup narrows)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def make_probe_fn(wiring: ProbeWiring) -> Callable[[Iterator], Iterator]:
    def probe(_batches: Iterator) -> Iterator:
        started = time.perf_counter()
        import pyarrow as pa
        import torch
        from pyspark import BarrierTaskContext

        from pipeline.launch.strategy.link_probe import probe_link
        from pipeline.models import build_model, loss_fn
        from pipeline.wire.deadline import Timeout

        context = BarrierTaskContext.get()
        rank = context.partitionId()
        hosts_of = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
        host = hosts_of[rank]
        row: dict[str, Optional[object]] = {"rank": rank, "host": host, "kernel": kernel_id(), "cores": cores(),
                                            "hosts": len(set(hosts_of)),
                                            "ranks_per_host": max(hosts_of.count(h) for h in hosts_of),
                                            "error": None}
        try:
            model = build_model(wiring.spec)
            arrays, array_labels, row["data_s"] = read_batch(wiring.files, wiring.fields, wiring.batch_size)
            inputs = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
            labels = torch.from_numpy(array_labels.copy())
            row.update(local_costs(model, inputs, labels, loss_fn(wiring.spec), topk_ratio=wiring.topk_ratio,
                                   repeats=wiring.repeats, budget_s=COMPUTE_BUDGET_S))
            if hosts_of.index(host) == rank:  # the first task of its host measures the host's link
                row["link_s"] = time.perf_counter()
                probe_link(*wiring.server, wiring.secret, rank=rank, own_host=host, hosts=row["hosts"],
                           timeout=Timeout(wiring.timeout_s, "timeouts.connect_s"))
                row["link_s"] = time.perf_counter() - row["link_s"]
        except Exception as exc:  # noqa: BLE001 - a probe failure is reported, the driver decides
            row["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        row["task_s"] = time.perf_counter() - started
        names = [f.split()[0] for f in RESULT_DDL.split(", ")]
        yield pa.RecordBatch.from_pylist([{k: row.get(k) for k in names}],
                                         schema=pa.schema([(n, pa.string() if n in ("host", "kernel", "error") else
                                                            pa.int32() if n in ("rank", "cores", "hosts",
                                                                                "ranks_per_host")
                                                            else pa.float64()) for n in names]))
    return probe
