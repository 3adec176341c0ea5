"""Pipeline stages as workers of the per-stage parameter servers, stages in threads (no Spark): the
parameters after k steps equal single-process training on the same batches."""
import dataclasses
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.models import ModelSpec, build_model, flat_parameters, load_flat_parameters, loss_fn
from pipeline.parallel.link import StageListener
from pipeline.parallel.stages import split_stages, stage_slices
from pipeline.ps import OptimizerSpec, PSSettings, new_secret
from pipeline.ps.server.staged import StagedParameterServer
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import WorkerPlan, run
from pipeline.worker.loop import InjectedFault, make_train_loader
from pipeline.worker.plan import Deadlines, FaultPlan, LoaderPlan, StagePlan
from pipeline.worker.stage_loop import StageWiring

SPEC = ModelSpec(kind="mlp", num_features=4, num_outputs=3, task="classification", hidden=(16, 12))
OPTIMIZER = OptimizerSpec(lr=0.1, momentum=0.9)


def _shard(path, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (np.digitize(x[:, 0] + x[:, 1], [-0.5, 0.5])).astype(np.int64)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": y}, ), path, row_group_size=16)
    return str(path)


def _plans(tmp_path, replicas, stages, micro_batches, epochs=2, steps=8, faults=None):
    shards = [_shard(tmp_path / f"s{d}.parquet", 64, d) for d in range(replicas)]
    plans = []
    for rank in range(replicas * stages):
        replica, stage = divmod(rank, stages)
        grid = StagePlan(stage=stage, stages=stages, replica=replica, replicas=replicas,
                         micro_batches=micro_batches, cuts=None)
        plans.append(WorkerPlan(
            rank=rank, world_size=replicas * stages, generation=1,
            train_files=(shards[replica],) if stage in (0, stages - 1) else (), validation_files=(),
            model=SPEC, features_field="features", label_field="label", epochs=epochs, steps_per_epoch=steps,
            seed=0, loader=LoaderPlan(prefetch=2), deadlines=Deadlines.all(10), stage=grid,
            faults=faults or FaultPlan(), optimizer=OPTIMIZER))
    return plans


def _train(plans, stages, replicas, on_metrics=None, shards=1):
    torch.manual_seed(0)
    initial = flat_parameters(build_model(SPEC))
    ranges = stage_slices(split_stages(build_model(SPEC), stages))
    secret = new_secret()
    results, errors = {}, {}
    listeners = {p.rank: StageListener("127.0.0.1", secret, 1, stage=p.rank % stages, rank=p.rank,
                                       expect_rank=p.rank - 1, timeout_s=10)
                 for p in plans if p.rank % stages > 0}
    settings = PSSettings(optimizer=OPTIMIZER, shards=shards, step_timeout=Timeout.of(10, STEP_KEY))
    with StagedParameterServer(initial, ranges, settings, replicas=replicas, secret=secret, host="127.0.0.1",
                               on_metrics=on_metrics) as server:
        def target(plan):
            stage = plan.rank % stages
            wiring = StageWiring(listeners.get(plan.rank),
                                 listeners[plan.rank + 1].address if stage < stages - 1 else None)
            try:
                results[plan.rank] = run(plan, *server.addresses[stage], secret, wiring=wiring)
            except Exception as exc:  # collected for the assertions
                errors[plan.rank] = exc

        threads = [threading.Thread(target=target, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        deadline = time.monotonic() + 5
        while errors and not server.root_failures and time.monotonic() < deadline:
            time.sleep(0.05)
        return initial, server.parameters(), server.version, dict(server.root_failures), results, errors


def _single_process(initial, plans, replicas, stages, epochs=2):
    """The same model, optimizer and batches in one process: the mean of the replicas' mean losses."""
    model = build_model(SPEC)
    load_flat_parameters(model, initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=OPTIMIZER.lr, momentum=OPTIMIZER.momentum)
    loss = loss_fn("classification")
    loaders = [make_train_loader(dataclasses.replace(plans[d * stages], rank=d)) for d in range(replicas)]
    for epoch in range(epochs):
        for batches in zip(*(loader.epoch(epoch) for loader in loaders)):
            optimizer.zero_grad()
            (sum(loss(model(x), y) for x, y in batches) / replicas).backward()
            optimizer.step()
    return flat_parameters(model)


@pytest.mark.parametrize("replicas,stages,micro_batches", [(1, 2, 4), (1, 3, 4), (2, 2, 2), (2, 3, 3)])
def test_pipeline_stages_match_single_process_training(tmp_path, replicas, stages, micro_batches):
    plans = _plans(tmp_path, replicas, stages, micro_batches)
    reports = []
    initial, params, version, _, results, errors = _train(plans, stages, replicas,
                                                          on_metrics=lambda r, m: reports.append((r, m)))
    assert errors == {}
    assert version == 16 and {r.steps for r in results.values()} == {16}
    expected = _single_process(initial, plans, replicas, stages)
    assert not torch.equal(params, initial)
    assert torch.allclose(params, expected, atol=1e-5), (params - expected).abs().max()
    # Per-stage metrics reach the driver: every rank reports every epoch with its stage and bubble.
    epochs = [(m["epoch"], r) for r, m in reports if "epoch" in m]
    assert sorted(epochs) == [(e, r) for e in range(2) for r in range(replicas * stages)]
    for rank, m in reports:
        if "epoch" in m:
            assert m["stage"] == rank % stages and 0 <= m["bubble_fraction"] <= 1 and m["compute_s"] > 0
            assert ("train_loss" in m) == (rank % stages == stages - 1)
            assert m["bytes_sent"] > 0


def test_each_stage_server_can_itself_be_sharded(tmp_path):
    """ps.shards applies inside every stage's server: same parameters as unsharded training."""
    plans = _plans(tmp_path, 2, 2, 2)
    initial, params, version, _, _, errors = _train(plans, 2, 2, shards=3)
    assert errors == {} and version == 16
    assert torch.allclose(params, _single_process(initial, plans, 2, 2), atol=1e-5)


def test_a_failing_stage_is_the_root_cause_and_its_neighbours_stop(tmp_path):
    plans = _plans(tmp_path, 1, 3, 2, faults=FaultPlan(fail_rank=1, fail_step=3))
    _, _, version, roots, _, errors = _train(plans, 3, 1)
    assert isinstance(errors[1], InjectedFault)
    assert list(roots) == [1]  # not the link errors stages 0 and 2 saw as a consequence
    assert sorted(errors) == [0, 1, 2]
    assert "pipeline link" in str(errors[0]) or "stage 1" in str(errors[0])
    assert version == 3


def test_a_factory_returning_stage_modules_is_cut_exactly_there(monkeypatch):
    import torch.nn as nn

    import pipeline.models.build as build
    from pipeline.worker.stage_loop import model_stages

    def factory(num_features, num_outputs):
        # Unbalanced on purpose: balancing by parameter count would cut elsewhere.
        return [nn.Sequential(nn.Linear(num_features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU()),
                nn.Sequential(nn.Linear(64, num_outputs))]

    monkeypatch.setattr(build, "_resolve_factory", lambda path: factory)
    spec = ModelSpec(kind="factory", num_features=4, num_outputs=3, task="classification", factory="x:y")
    model = build_model(spec)
    stages = model_stages(model, 2)
    assert [len(s) for s in stages] == [2, 1]  # stage 0: the input adapter + the first stage module
    assert torch.equal(torch.cat([flat_parameters(s) for s in stages]), flat_parameters(model))
    x = torch.randn(5, 4)
    assert torch.equal(stages[1](stages[0](x)), model(x))  # the whole model is the stages composed
