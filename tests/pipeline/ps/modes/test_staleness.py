"""Staleness-aware updates: each async/ssp gradient weighted 1/(1+s) on a real server, and the server
momentum net of what asynchrony implies, from the config to the PSSettings the launcher builds."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import build
from pipeline.errors import PSError
from pipeline.launch.plans import ps_settings
from pipeline.ps import OptimizerSpec
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.modes.staleness import implicit_momentum, server_momentum, server_optimizer, weight

N = 4


def test_the_inverse_rule_weighs_a_gradient_by_one_over_one_plus_its_staleness():
    assert [weight("inverse", s) for s in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert [weight("none", s) for s in (0, 1, 3)] == [1.0, 1.0, 1.0]
    with pytest.raises(PSError, match="ps.staleness_scale"):
        Consistency("async", staleness_scale="sqrt")


def test_async_applies_a_stale_push_at_its_weight(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=2, optimizer=OptimizerSpec(lr=1.0),
                         consistency=Consistency("async", staleness_scale="inverse"))
    a, b = make_client(server, 0), make_client(server, 1)
    a.connect(), b.connect()
    a.pull(0), b.pull(0)
    assert a.push(0, torch.ones(N)) == 0  # fresh: full weight
    assert b.push(0, torch.full((N,), 2.0)) == 1  # computed on version 0, applied to version 1: weight 1/2
    assert torch.equal(server.parameters(), torch.full((N,), -2.0))  # -1 - 2/2
    a.pull(0)  # rank 0 now computes on version 2
    b.push(1, torch.full((N,), 3.0))  # rank 1 still on version 0, applied to 2: weight 1/3
    assert torch.allclose(server.parameters(), torch.full((N,), -3.0))
    a.push(1, torch.full((N,), 3.0))  # version 2 -> applied to 3: weight 1/2
    assert torch.allclose(server.parameters(), torch.full((N,), -4.5))
    assert server.stats["staleness_max"] == 2


def test_async_with_adam_scales_the_steps_learning_rate(make_server, make_client):
    # Adam normalizes the gradient's size away: only a scaled learning rate can weigh a stale step.
    server = make_server(torch.zeros(N), world_size=2, optimizer=OptimizerSpec(name="adam", lr=0.1),
                         consistency=Consistency("async", staleness_scale="inverse"))
    a, b = make_client(server, 0), make_client(server, 1)
    a.connect(), b.connect()
    a.pull(0), b.pull(0)
    a.push(0, torch.zeros(N))  # fresh
    b.push(0, torch.ones(N))  # stale by 1: this step runs at lr 0.05
    reference = torch.zeros(N, requires_grad=True)
    adam = torch.optim.Adam([reference], lr=0.1)
    for grad, lr in ((torch.zeros(N), 0.1), (torch.ones(N), 0.05)):
        reference.grad = grad
        adam.param_groups[0]["lr"] = lr
        adam.step()
    assert torch.allclose(server.parameters(), reference.detach())
    assert not torch.allclose(server.parameters(), torch.zeros(N))


def test_ssp_weighs_each_gradient_of_a_clock_by_its_own_staleness(make_server, make_client, background):
    server = make_server(torch.zeros(N), world_size=2, optimizer=OptimizerSpec(lr=1.0),
                         consistency=Consistency("ssp", staleness=2, staleness_scale="inverse"))
    fast, slow = make_client(server, 0), make_client(server, 1)
    fast.connect(), slow.connect()
    fast.push(0, torch.ones(N))
    fast.pull(1)  # version 0: its clock-1 gradient is 1 version stale
    slow.push(0, torch.ones(N))  # clock 0 complete: -(1 + 1)/2
    assert torch.equal(server.parameters(), torch.full((N,), -1.0))
    slow.pull(1)  # version 1: fresh for clock 1
    fast.push(1, torch.full((N,), 4.0))  # weight 1/2 -> 2
    slow.push(1, torch.full((N,), 2.0))  # weight 1 -> 2; clock 1: -(2 + 2)/2
    assert torch.equal(server.parameters(), torch.full((N,), -3.0))
    assert server.stats["staleness_max"] == 1


def test_server_momentum_is_train_momentum_less_what_asynchrony_implies():
    assert implicit_momentum(0) == 0.0 and implicit_momentum(1) == 0.5 and implicit_momentum(3) == 0.75
    assert server_momentum(0.9, "async", 2) == pytest.approx(0.4)
    assert server_momentum(0.9, "async", 4) == pytest.approx(0.15)
    assert server_momentum(0.9, "async", 16) == 0.0  # never negative
    assert server_momentum(0.9, "ssp", 4, bound=1) == pytest.approx(0.4)  # tau capped by ps.staleness
    assert server_momentum(0.9, "ssp", 4, bound=0) == pytest.approx(0.9)  # ssp with bound 0 is sync
    assert server_momentum(0.9, "sync", 8) == 0.9 and server_momentum(0.9, "average", 8) == 0.9
    assert server_momentum(0.9, "async", 2, override=0.7) == 0.7
    adam = OptimizerSpec(name="adam", lr=0.01)
    assert server_optimizer(adam, "async", 2) is adam  # no momentum to correct


@pytest.mark.parametrize("mode, overrides, momentum, scale", [
    ("async", {}, 0.4, "inverse"),
    ("ssp", {}, 0.4, "inverse"),
    ("sync", {}, 0.9, "inverse"),
    ("async", {"async_momentum": 0.9, "staleness_scale": "none"}, 0.9, "none"),
])
def test_the_launcher_builds_the_servers_momentum_and_rule_from_the_config(mode, overrides, momentum, scale):
    cfg = build({"parallelism": {"data": 2}, "train": {"momentum": 0.9}, "ps": {"mode": mode, **overrides}})
    settings = ps_settings(cfg)
    assert settings.optimizer.momentum == pytest.approx(momentum)
    assert settings.consistency.staleness_scale == scale


def test_bad_staleness_keys_fail_at_load_time_naming_the_key():
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="ps.staleness_scale"):
        build({"ps": {"staleness_scale": "sqrt"}})
    with pytest.raises(ConfigError, match="ps.async_momentum"):
        build({"ps": {"async_momentum": 1.0}})
