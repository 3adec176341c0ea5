"""BatchNorm buffers through the worker loop and a real parameter server, ranks in threads (no Spark):
every replica's running statistics reach the server at epoch ends, the server's merge is the final
model's, and a new attempt's workers start from the merged buffers."""
import dataclasses

import pytest
import torch

from pipeline.launch.ps_side.buffers import buffer_store
from pipeline.models import ModelSpec, build_model, flat_buffers, flat_parameters, load_flat_state, loss_fn
from pipeline.models.state import join_state
from pipeline.ps import OptimizerSpec, ParameterServer, new_secret
from pipeline.ps.modes.consistency import Consistency, expected_version
from pipeline.worker.loop import make_train_loader
from pipeline.worker.plan import FaultPlan

from tests.pipeline.worker.test_loop import _plans, _run_ranks, _settings

OPTIMIZER = OptimizerSpec(lr=0.1, momentum=0.9)


@pytest.fixture(autouse=True)
def _user_models(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.path.parents[1] / "models"))  # model.factory "user_models:..."


def _bn_plans(tmp_path, faults=None, epochs=3):
    spec = ModelSpec(kind="factory", num_features=4, num_outputs=2, task="classification",
                     factory="user_models:bn_mlp", factory_kwargs={"width": 8})
    _, plans = _plans(tmp_path, epochs=epochs, faults=faults)
    return spec, [dataclasses.replace(p, model=spec, optimizer=OPTIMIZER) for p in plans]


def _server(spec, consistency, secret):
    torch.manual_seed(0)
    model = build_model(spec)
    return ParameterServer(flat_parameters(model), _settings(OPTIMIZER, consistency=consistency), world_size=2,
                           secret=secret, host="127.0.0.1", buffers=buffer_store(model, flat_buffers(model)))


def _bn(state, spec):
    model = build_model(spec)
    load_flat_state(model, state)
    return _norm(model)


def _norm(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d))


def test_sync_merges_each_replicas_running_statistics_exactly(tmp_path):
    spec, plans = _bn_plans(tmp_path)
    secret = new_secret()
    with _server(spec, Consistency("sync"), secret) as server:
        initial = join_state(server.parameters(), server.buffers())
        results, errors = _run_ranks(plans, server, secret)
        assert errors == {} and server.version == 3 * 8
        final = join_state(server.parameters(), server.buffers())
    # Replay: one replica per rank, sharing the parameters after every step (the PS's averaged step), each
    # keeping its own running statistics as a worker does; the merge is their mean.
    replicas = [build_model(spec) for _ in range(2)]
    for replica in replicas:
        load_flat_state(replica, initial)
        replica.train()
    opt = torch.optim.SGD(replicas[0].parameters(), lr=0.1, momentum=0.9)
    loss = loss_fn("classification")
    loaders = [make_train_loader(plan) for plan in plans]
    for epoch in range(3):
        for batches in zip(*(loader.epoch(epoch) for loader in loaders)):
            for replica in replicas[1:]:
                replica.load_state_dict({k: v for k, v in replicas[0].state_dict().items() if "running" not in k
                                         and "num_batches" not in k}, strict=False)
            opt.zero_grad()
            losses = [loss(replica(x), y) for replica, (x, y) in zip(replicas, batches)]
            grads = [torch.autograd.grad(l, list(r.parameters())) for l, r in zip(losses, replicas)]
            for p, *gs in zip(replicas[0].parameters(), *grads):
                p.grad = sum(gs) / 2
            opt.step()
    bn = _bn(final, spec)
    expected_mean = (_norm(replicas[0]).running_mean + _norm(replicas[1]).running_mean) / 2
    expected_var = (_norm(replicas[0]).running_var + _norm(replicas[1]).running_var) / 2
    assert torch.allclose(bn.running_mean, expected_mean, atol=1e-5)
    assert torch.allclose(bn.running_var, expected_var, atol=1e-5)
    assert bn.num_batches_tracked.item() == 24  # an integer counter, from rank 0, not a float average
    assert torch.allclose(final[:flat_parameters(replicas[0]).numel()], flat_parameters(replicas[0]), atol=1e-5)
    assert not torch.allclose(bn.running_mean, torch.zeros(8))


@pytest.mark.parametrize("mode", ["async", "average"])
def test_every_mode_ends_with_trained_running_statistics(tmp_path, mode):
    consistency = Consistency(mode, sync_every=3)
    spec, plans = _bn_plans(tmp_path)
    secret = new_secret()
    with _server(spec, consistency, secret) as server:
        results, errors = _run_ranks(plans, server, secret)
        assert errors == {} and server.version == expected_version(consistency, 24, 2)
        assert server._buffers.reported_ranks == {0, 1}
        bn = _bn(join_state(server.parameters(), server.buffers()), spec)
    assert bn.num_batches_tracked.item() == 24
    assert not torch.allclose(bn.running_mean, torch.zeros(8)) and not torch.allclose(bn.running_var, torch.ones(8))


def test_a_retried_attempt_starts_from_the_buffers_of_the_last_epoch_end(tmp_path):
    # Attempt 1 fails in epoch 1 (8 steps per epoch); attempt 2 resumes at the server's step. Its workers
    # pull the merged buffers of epoch 0's end (8 batches), then run the remaining steps: the statistics of
    # the steps between epoch 0's end and the failure were never merged, so they are not in the count.
    spec, plans = _bn_plans(tmp_path, faults=FaultPlan(fail_rank=1, fail_step=11))
    secret = new_secret()
    with _server(spec, Consistency("sync"), secret) as server:
        _, errors = _run_ranks(plans, server, secret)
        assert sorted(errors) == [0, 1] or list(errors) == [1]
        failed_at = server.version
        assert 8 < failed_at < 16
        after_epoch_0 = _bn(join_state(server.parameters(), server.buffers()), spec).num_batches_tracked.item()
        assert after_epoch_0 == 8
        generation = server.new_generation()
        retry = [dataclasses.replace(p, generation=generation, faults=FaultPlan()) for p in plans]
        results, errors = _run_ranks(retry, server, secret)
        assert errors == {} and server.version == 24
        bn = _bn(join_state(server.parameters(), server.buffers()), spec)
    assert bn.num_batches_tracked.item() == 8 + (24 - failed_at)  # not 24 - failed_at: it started from 8
