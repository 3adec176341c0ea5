"""The barrier task's body outside Spark: a rank that fails before it connected (its device) still tells
the parameter server, so peers waiting for it stop at once; a real server on 127.0.0.1."""
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import PSError, PSTimeoutError
from pipeline.launch.task.body import TaskWiring, run_rank
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, PSSettings, new_secret
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import WorkerPlan
from pipeline.worker.plan import Deadlines, LoaderPlan


def _plan(tmp_path, spec, rank, world, backend):
    path = tmp_path / f"s{rank}.parquet"
    x = np.random.default_rng(rank).normal(size=(32, 4)).astype(np.float32)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4)
    pq.write_table(pa.table({"features": features, "label": (x[:, 0] > 0).astype(np.int64)}), path)
    return WorkerPlan(rank=rank, world_size=world, generation=1, train_files=(str(path),), validation_files=(),
                      model=spec, features_field="features", label_field="label", epochs=1, steps_per_epoch=2,
                      seed=0, loader=LoaderPlan(prefetch=0), optimizer=OptimizerSpec(lr=0.1), backend=backend,
                      deadlines=Deadlines.all(30))


@pytest.mark.skipif(torch.cuda.is_available(), reason="binding cuda:7 must fail: a CPU-only process")
def test_a_rank_whose_device_fails_before_connecting_fails_its_waiting_peer_at_once(tmp_path):
    spec = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))
    secret = new_secret()
    settings = PSSettings(optimizer=OptimizerSpec(lr=0.1), step_timeout=Timeout.of(30, STEP_KEY))
    with ParameterServer(flat_parameters(build_model(spec)), settings, world_size=2, secret=secret,
                         host="127.0.0.1") as server:
        outcome = []

        def rank_0_meets():  # what rank 0 of a flat allreduce run waits in (pipeline.ps.server.meeting)
            with PSClient(*server.address, rank=0, secret=secret, timeout_s=30) as client:
                client.connect()
                try:
                    client.rendezvous({"device": "cpu", "allreduce": ["127.0.0.1", 4242]})
                except PSError as exc:
                    outcome.append(exc)

        waiter = threading.Thread(target=rank_0_meets, daemon=True)
        waiter.start()
        wiring = TaskWiring(secret=secret, log_tail_lines=20, ps=server.address)
        # No CUDA in this process: binding cuda:7 fails before rank 1 ever connects.
        row = run_rank(_plan(tmp_path, spec, 1, 2, "allreduce"), server.address, wiring, device="cuda:7")
        waiter.join(10)  # far below the 30 s deadlines: only rank 1's FAIL can end the wait this soon
        assert not waiter.is_alive()
        failures = server.failures  # rank 0's own drop follows, as a consequence
    assert row["ok"] is False and row["rank"] == 1
    assert failures[1].error == row["error"]  # the row's error, as the FAIL carried it
    error = outcome[0]
    assert not isinstance(error, PSTimeoutError) and "rank(s) 1" in str(error)
