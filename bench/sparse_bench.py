"""Sparse embedding tables on the PS against allreduce (DDP) of the same model with a dense table, and one process.

    .venv/bin/python bench/sparse_bench.py            # --quick (the default): tables of 1e5 and 1e6 rows
    .venv/bin/python bench/sparse_bench.py --full     # 1e5, 1e6 and 1e7 rows (1.28 GB fp32 at dim 32)

Data: a synthetic click log (13 dense N(0, 1) columns, 26 categorical columns of Zipf(1.1) ids, one
shared hashed table of ``rows`` x 32: id = mix64(column, value) % rows), labels drawn from a known
logistic teacher. Model: the 26 embeddings and the dense columns -> Linear(845, 64) -> ReLU -> Linear(64, 1);
tables trained with Adagrad (lr 0.05), the dense part with SGD (lr 0.1). Per table size:

* ``single``: one process, a dense ``nn.Embedding``, global batch (2 x the per-worker batch);
* ``ddp``: 2 worker processes, gloo ``DistributedDataParallel`` over the same dense model (every step
  allreduces the whole table's gradient), at most ``--ddp-steps`` steps (it is the slow one);
* ``sparse``: 2 worker processes through the shardline PS (this process), ``ShardlineEmbedding`` rows
  pulled/pushed per step (sync mode).

Columns: train samples/s (all workers, after one warm-up step), bytes moved per step per worker (PS:
the socket's bytes both ways; DDP: a ring allreduce's 2(n-1)/n x gradient bytes), each worker's peak
RSS above its RSS before building the model (VmHWM - VmRSS), test ROC AUC (n/a where DDP was capped).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

DIM, DENSE, CATS, WORKERS = 32, 13, 26, 2


def _mix(x: np.ndarray) -> np.ndarray:
    from pipeline.ps.sparse.hashing import mix64

    return mix64(x.astype(np.int64))


def make_data(rows: int, samples: int, seed: int = 0):
    """(dense float32 [n, 13], ids int64 [n, 26] into a table of ``rows``, labels float32 [n])."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((samples, DENSE)).astype(np.float32)
    vocab = max(rows // CATS, 10)
    values = np.minimum(rng.zipf(1.1, (samples, CATS)), vocab) - 1
    keys = values + np.arange(CATS)[None, :] * (1 << 32)
    hashed = _mix(keys)
    ids = (hashed % np.uint64(rows)).astype(np.int64)
    effect = ((hashed >> np.uint64(11)).astype(np.float64) / (1 << 53) - 0.5) * 3.0  # the teacher's per-id weight
    w = np.random.default_rng(1).standard_normal(DENSE) * 0.5
    logit = dense @ w + effect.sum(axis=1) / np.sqrt(CATS) - 0.5
    labels = (rng.random(samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return dense, ids, labels


def build(rows: int, sparse: bool):
    import torch
    import torch.nn as nn

    from pipeline.models.sparse_embedding import ShardlineEmbedding

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = ShardlineEmbedding("ids", rows, DIM, init_std=0.1) if sparse else nn.Embedding(rows, DIM)
            if not sparse:
                with torch.no_grad():
                    self.table.weight.normal_(0, 0.1)
            self.mlp = nn.Sequential(nn.Linear(CATS * DIM + DENSE, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, dense, ids):
            return self.mlp(torch.cat([self.table(ids).flatten(1), dense], dim=1)).squeeze(1)

    torch.manual_seed(0)
    return Net()


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _batches(data, rank: int, world: int, batch: int, steps: int):
    dense, ids, labels = data
    for step in range(steps):
        start = (step * world + rank) * batch
        sl = slice(start % len(labels), start % len(labels) + batch)
        yield dense[sl], ids[sl], labels[sl]


def _auc(model, test) -> float:
    import torch
    from sklearn.metrics import roc_auc_score

    model.eval()
    with torch.no_grad():
        scores = model(torch.from_numpy(test[0]), torch.from_numpy(test[1])).numpy()
    return float(roc_auc_score(test[2], scores))


def _optimizers(model, sparse: bool):
    import torch

    opts = [torch.optim.SGD(model.mlp.parameters(), lr=0.1)]
    if not sparse:
        opts.append(torch.optim.Adagrad(model.table.parameters(), lr=0.05))
    return opts


def run_single(rows: int, train, test, batch: int, steps: int) -> dict:
    import torch

    before = _rss_kib("VmRSS")
    model = build(rows, sparse=False)
    opts = _optimizers(model, False)
    t0 = None
    for i, (d, ids, y) in enumerate(_batches(train, 0, 1, batch * WORKERS, steps)):
        if i == 1:
            t0 = time.perf_counter()
        for o in opts:
            o.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(torch.from_numpy(d), torch.from_numpy(ids)),
                                                             torch.from_numpy(y)).backward()
        for o in opts:
            o.step()
    seconds = time.perf_counter() - t0
    return {"samples_s": (steps - 1) * batch * WORKERS / seconds, "bytes_step": 0,
            "rss_mb": (_rss_kib("VmHWM") - before) / 1024, "auc": _auc(model, test)}


def _ddp_worker(rank, rows, train, test, batch, steps, port, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    before = _rss_kib("VmRSS")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    model = build(rows, sparse=False)
    ddp = DistributedDataParallel(model)
    opts = _optimizers(model, False)
    t0 = time.perf_counter()
    for i, (d, ids, y) in enumerate(_batches(train, rank, WORKERS, batch, steps)):
        if i == 1:
            t0 = time.perf_counter()
        for o in opts:
            o.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(ddp(torch.from_numpy(d), torch.from_numpy(ids)),
                                                             torch.from_numpy(y)).backward()
        for o in opts:
            o.step()
    seconds = time.perf_counter() - t0
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    out.put({"rank": rank, "seconds": seconds, "rss_mb": (_rss_kib("VmHWM") - before) / 1024,
             "bytes_step": 2 * (WORKERS - 1) / WORKERS * grad_bytes, "auc": _auc(model, test) if rank == 0 else None})
    dist.destroy_process_group()


def _sparse_worker(rank, rows, train, batch, steps, host, port, secret, out):
    import torch

    from pipeline.models import flat_gradients, load_flat_parameters
    from pipeline.models.sparse_embedding import sparse_modules
    from pipeline.ps import PSClient
    from pipeline.worker.sparse_hook import SparseHook

    torch.set_num_threads(1)
    before = _rss_kib("VmRSS")
    model = build(rows, sparse=True)
    with PSClient(host, port, rank=rank, secret=secret, timeout_s=120.0) as client:
        client.connect()
        hook = SparseHook(client, sparse_modules(model))
        _, params = client.pull(0)
        load_flat_parameters(model, params)
        t0, moved0 = time.perf_counter(), 0
        for i, (d, ids, y) in enumerate(_batches(train, rank, WORKERS, batch, steps)):
            if i == 1:
                t0, moved0 = time.perf_counter(), _moved(client)
            hook.before_forward(i)
            model.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(model(torch.from_numpy(d), torch.from_numpy(ids)),
                                                                 torch.from_numpy(y)).backward()
            hook.after_backward(i)
            _, params = client.push_pull(i, flat_gradients(model))
            load_flat_parameters(model, params)
        seconds, moved = time.perf_counter() - t0, _moved(client) - moved0
        client.finish()
    out.put({"rank": rank, "seconds": seconds, "rss_mb": (_rss_kib("VmHWM") - before) / 1024,
             "bytes_step": moved / max(steps - 1, 1), "auc": None})


def _moved(client) -> int:
    channel = client._links[0].channel
    return channel.bytes_sent + channel.bytes_received


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather(procs, out) -> list[dict]:
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    return sorted(results, key=lambda r: r["rank"])


def run_ddp(rows, train, test, batch, steps) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, rows, train, test, batch, steps, port, out)) for r in range(WORKERS)]
    for p in procs:
        p.start()
    res = _gather(procs, out)
    seconds = max(r["seconds"] for r in res)
    return {"samples_s": (steps - 1) * batch * WORKERS / seconds, "bytes_step": res[0]["bytes_step"],
            "rss_mb": max(r["rss_mb"] for r in res), "auc": res[0]["auc"]}


def run_sparse(rows, train, test, batch, steps) -> dict:
    from pipeline.models import flat_parameters
    from pipeline.models.sparse_embedding import sparse_modules
    from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
    from pipeline.ps.modes.consistency import Consistency
    from pipeline.ps.sparse.rowopt import RowOptimizerSpec
    from pipeline.ps.sparse.store import SparseStore
    from pipeline.ps.sparse.table import SparseTable
    from pipeline.wire.deadline import STEP_KEY, Timeout

    model = build(rows, sparse=True)
    store = SparseStore([SparseTable(m.spec, RowOptimizerSpec("adagrad", lr=0.05), shards=4)
                         for m in sparse_modules(model)], Consistency(), WORKERS)
    settings = PSSettings(optimizer=OptimizerSpec("sgd", lr=0.1), step_timeout=Timeout.of(120.0, STEP_KEY))
    secret = new_secret()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with ParameterServer(flat_parameters(model), settings, world_size=WORKERS, secret=secret, host="127.0.0.1",
                         sparse=store) as server:
        host, port = server.address
        procs = [ctx.Process(target=_sparse_worker, args=(r, rows, train, batch, steps, host, port, secret, out))
                 for r in range(WORKERS)]
        for p in procs:
            p.start()
        res = _gather(procs, out)
        from pipeline.models import load_flat_parameters

        load_flat_parameters(model, server.parameters())
        ids, table_rows = store.tables[0].read_rows()
        touched = len(ids)
    model.table.load_rows(ids, table_rows)
    seconds = max(r["seconds"] for r in res)
    return {"samples_s": (steps - 1) * batch * WORKERS / seconds, "bytes_step": max(r["bytes_step"] for r in res),
            "rss_mb": max(r["rss_mb"] for r in res), "auc": _auc(model, test), "touched": touched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="add the 1e7-row table (1.28 GB fp32)")
    parser.add_argument("--quick", action="store_true", help="the default: 1e5 and 1e6 rows")
    parser.add_argument("--samples", type=int, default=120_000, help="training rows (the test split is 1/4 more)")
    parser.add_argument("--batch", type=int, default=512, help="rows per worker per step")
    parser.add_argument("--ddp-steps", type=int, default=12, help="DDP stops after this many steps")
    parser.add_argument("--only", nargs="*", default=["single", "ddp", "sparse"])
    args = parser.parse_args()
    sizes = [100_000, 1_000_000] + ([10_000_000] if args.full else [])
    steps = args.samples // (args.batch * WORKERS)
    print(f"{WORKERS} workers, batch {args.batch}/worker, {steps} steps (DDP at most {args.ddp_steps}), "
          f"dim {DIM}, {CATS} categorical + {DENSE} dense columns, cpu {os.cpu_count()}", flush=True)
    header = f"{'rows':>10} {'mode':>7} {'samples/s':>10} {'vs ddp':>7} {'MB/step':>9} {'peak RSS MB':>12} {'AUC':>7} {'dAUC':>7}"
    lines = []
    for rows in sizes:
        data = make_data(rows, args.samples + args.samples // 4)
        cut = args.samples
        train = tuple(a[:cut] for a in data)
        test = tuple(a[cut:] for a in data)
        results = {}
        for mode in args.only:
            if mode == "single" and rows > 1_000_000 and not args.full:
                continue
            fn = {"single": run_single, "ddp": run_ddp, "sparse": run_sparse}[mode]
            n = min(steps, args.ddp_steps) if mode == "ddp" else steps
            results[mode] = fn(rows, train, test, args.batch, n)
            if mode == "ddp" and n < steps:
                results[mode]["auc"] = None  # capped: not trained on the data
            print(f"  {rows:.0e} {mode}: {results[mode]}", flush=True)
        for mode, r in results.items():
            ddp = results.get("ddp", {}).get("samples_s")
            ref = results.get("single", {}).get("auc")
            auc = "n/a" if r["auc"] is None else f"{r['auc']:.4f}"
            dauc = "" if r["auc"] is None or ref is None else f"{r['auc'] - ref:+.4f}"
            lines.append(f"{rows:>10.0e} {mode:>7} {r['samples_s']:>10.0f} "
                         f"{(r['samples_s'] / ddp if ddp else float('nan')):>6.1f}x {r['bytes_step'] / 1e6:>9.2f} "
                         f"{r['rss_mb']:>12.0f} {auc:>7} {dauc:>7}")
    print(header)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
