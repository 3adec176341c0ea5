"""The worker loop against a real parameter server, ranks in threads (no Spark)."""
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import PSError
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.ps import OptimizerSpec, ParameterServer, new_secret
from pipeline.worker import WorkerPlan, run
from pipeline.worker.loop import InjectedFault


def _shard(path, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": y}), path)
    return str(path)


def _plans(tmp_path, world=2, epochs=3, steps=8, extra=None):
    spec = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))
    return spec, [WorkerPlan(rank=r, world_size=world, generation=1,
                             train_files=(_shard(tmp_path / f"s{r}.parquet", 64, r),),
                             validation_files=(_shard(tmp_path / "val.parquet", 32, 99),) if r == 0 else (),
                             model=spec.to_dict(), task="classification", num_features=4,
                             features_field="features", label_field="label", epochs=epochs, steps_per_epoch=steps,
                             seed=0, prefetch=2, ps_timeout_s=10, extra=extra or {})
                  for r in range(world)]


def _run_ranks(plans, server, secret):
    results, errors = {}, {}

    def target(plan):
        try:
            results[plan.rank] = run(plan, *server.address, secret)
        except Exception as exc:  # collected for the assertions
            errors[plan.rank] = exc

    threads = [threading.Thread(target=target, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_two_ranks_train_in_lockstep_and_report_epochs(tmp_path):
    spec, plans = _plans(tmp_path)
    torch.manual_seed(0)
    initial = flat_parameters(build_model(spec))
    reports = []
    secret = new_secret()
    with ParameterServer(initial, world_size=2, secret=secret, optimizer=OptimizerSpec(lr=0.1, momentum=0.9),
                         host="127.0.0.1", timeout_s=10, on_metrics=lambda r, m: reports.append((r, m))) as server:
        results, errors = _run_ranks(plans, server, secret)
        assert errors == {}
        assert server.version == 3 * 8
        assert not torch.equal(server.parameters(), initial)
    assert {r.steps for r in results.values()} == {24}
    assert sum(r.samples for r in results.values()) == 3 * 128
    epochs = sorted((m["epoch"], r) for r, m in reports)
    assert epochs == [(e, r) for e in range(3) for r in (0, 1)]
    assert all("val_accuracy" in m for r, m in reports if r == 0)
    assert not any("val_accuracy" in m for r, m in reports if r == 1)
    losses = [m["train_loss"] for r, m in sorted(reports, key=lambda x: x[1]["epoch"]) if r == 0]
    assert losses[-1] < losses[0]


def test_a_failing_rank_releases_its_peer_with_its_rank_named(tmp_path):
    spec, plans = _plans(tmp_path, extra={"fail_rank": 0, "fail_step": 2})
    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), world_size=2, secret=secret,
                         optimizer=OptimizerSpec(), host="127.0.0.1", timeout_s=10) as server:
        results, errors = _run_ranks(plans, server, secret)
        assert isinstance(errors[0], InjectedFault)
        assert isinstance(errors[1], PSError) and "rank 0" in str(errors[1])
        assert list(server.root_failures) == [0]
        assert sorted(server.failures) == [0, 1]  # rank 1 dropped out after, as a consequence
        assert server.version == 2
