"""Acceptance: a table larger than a worker may hold (1e7 x 32 declared = 1.28 GB fp32) trains with the
worker's memory bounded by what its batches touch. The worker runs in its own process (the server, with
the rows it materialises, in this one) and measures its own allocations: tracemalloc's peak over the
training steps (every Python-level buffer: received rows, ids, pushed payloads) and the largest rows the
module held in torch tensors in any step."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from pipeline.models import flat_parameters
from pipeline.ps import new_secret
from pipeline.ps.sparse.rowopt import RowOptimizerSpec
from tests.pipeline.ps.sparse.helpers import make_server

ROWS, DIM, STEPS, BATCH = 10_000_000, 32, 6, 1024
TABLE_BYTES = ROWS * DIM * 4

WORKER = r"""
import json, sys, tracemalloc
import numpy as np, torch, torch.nn as nn
from pipeline.models import flat_gradients, load_flat_parameters
from pipeline.models.sparse_embedding import ShardlineEmbedding, sparse_modules
from pipeline.ps import PSClient
from pipeline.worker.sparse_hook import SparseHook

host, port, secret, rows, dim, steps, batch = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), *map(int, sys.argv[4:8])
torch.manual_seed(0)
model = nn.Sequential(ShardlineEmbedding("big", rows, dim), nn.Flatten(), nn.Linear(dim, 1))
rng = np.random.default_rng(0)
with PSClient(host, port, rank=0, secret=secret, timeout_s=20.0) as client:
    client.connect()
    hook = SparseHook(client, sparse_modules(model))
    _, params = client.pull(0)
    load_flat_parameters(model, params)
    held = 0
    tracemalloc.start()
    for step in range(steps):
        ids = torch.from_numpy(np.minimum(rng.zipf(1.1, batch), rows) - 1).reshape(batch, 1)
        hook.before_forward(step)
        model.zero_grad()
        loss = model(ids).square().mean()
        loss.backward()
        held = max(held, sum(leaf.numel() * leaf.element_size() * 2 for _, leaf in model[0].pulled))  # rows + grad
        hook.after_backward(step)
        _, params = client.push_pull(step, flat_gradients(model))
        load_flat_parameters(model, params)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    client.finish()
print(json.dumps({"tracemalloc_peak": peak, "torch_rows_held": held,
                  "dense_parameters": sum(p.numel() for p in model.parameters())}))
"""


def test_a_table_larger_than_a_worker_may_hold_trains_in_bounded_worker_memory():
    secret = new_secret()
    torch.manual_seed(0)
    import torch.nn as nn

    from pipeline.models.sparse_embedding import ShardlineEmbedding

    model = nn.Sequential(ShardlineEmbedding("big", ROWS, DIM), nn.Flatten(), nn.Linear(DIM, 1))
    assert flat_parameters(model).numel() == DIM + 1  # the table is not in the dense vector
    server = make_server(model, secret, world_size=1, row_opt=RowOptimizerSpec("adagrad", lr=0.1), timeout_s=20.0)
    try:
        host, port = server.address
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        done = subprocess.run([sys.executable, "-c", WORKER, host, str(port), secret.hex(), str(ROWS), str(DIM),
                               str(STEPS), str(BATCH)], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        touched = server.stats["sparse"]["tables"]["big"]["rows"]
        assert server.version == STEPS and 0 < touched <= STEPS * BATCH
        # Bounded by a step's distinct rows (<= BATCH), never by the declared table:
        assert report["torch_rows_held"] <= 2 * BATCH * DIM * 4
        assert report["tracemalloc_peak"] < 0.01 * TABLE_BYTES, report  # < 12.8 MB of a 1.28 GB table
        assert report["dense_parameters"] == DIM + 1
    finally:
        server.close()
