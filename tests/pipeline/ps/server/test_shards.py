"""ps.shards: the parameters split into balanced slices, one listener per slice, one connection per
(worker, shard); the results, failures and deadlines are those of a single server."""
from __future__ import annotations

import threading

import pytest
import torch

from pipeline.errors import PSError, PSTimeoutError
from pipeline.ps import OptimizerSpec
from pipeline.ps.modes.consistency import Consistency, expected_version
from pipeline.ps.server.parameter_server import partition

N = 11  # not a multiple of the shard counts below: slices of unequal length


def test_partition_is_balanced_contiguous_and_covers_everything():
    assert partition(11, 3) == [(0, 4), (4, 8), (8, 11)]
    assert partition(5, 1) == [(0, 5)]
    with pytest.raises(PSError, match=r"ps\.shards"):
        partition(2, 3)


def test_welcome_of_shard_0_carries_every_shard_address_and_range(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=1, shards=3)
    c = make_client(server, 0)
    info = c.connect()
    assert c.num_shards == 3 and info.num_params == N
    assert [(s.start, s.end) for s in info.shards] == [(0, 4), (4, 8), (8, 11)]
    assert [(s.host, s.port) for s in info.shards] == [(a.host, a.port) for a in server.shards]
    assert len({s.port for s in info.shards}) == 3  # a listener each
    assert server.registered_ranks == {0}


def _steps(server, client, mode: str, grads: list[torch.Tensor]) -> None:
    """One rank through ``grads`` the way its exchange would (world_size 1: deterministic)."""
    version, _ = client.pull(0)
    for step, grad in enumerate(grads):
        client.push(step if mode != "average" else version, grad)
        version, _ = client.pull(step + 1 if mode != "async" else 0)


@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "average"])
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_every_mode_and_compression_gives_the_result_of_one_shard(make_server, make_client, mode, compression):
    torch.manual_seed(0)
    initial = torch.randn(N)
    grads = [torch.randn(N) for _ in range(4)]
    consistency = Consistency(mode, staleness=1, sync_every=1)
    results = []
    for shards in (1, 3):
        server = make_server(initial, world_size=1, shards=shards, consistency=consistency,
                             compression=compression, optimizer=OptimizerSpec(name="adam", lr=0.1))
        c = make_client(server, 0)
        c.connect()
        _steps(server, c, mode, grads)
        assert server.version == expected_version(consistency, 4, 1)
        results.append(server.parameters())
    assert torch.equal(results[0], results[1])


def test_topk_runs_per_shard_and_loses_no_gradient_mass(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=1, shards=2, compression="topk", topk_ratio=0.2,
                         optimizer=OptimizerSpec(name="sgd", lr=1.0))
    c = make_client(server, 0)
    c.connect()
    grads = [torch.randn(N) for _ in range(3)]
    _steps(server, c, "sync", grads)
    applied = -server.parameters()  # sgd lr 1 from zero: minus the sum of what was applied
    residual = torch.cat([link.compressor.residual for link in c._links])
    assert torch.allclose(applied + residual, torch.stack(grads).sum(0), atol=1e-5)
    assert server.stats["by_shard"][0]["push_payload_bytes"] == 3 * 8 * 2  # ceil(0.2 * 6) entries


def _pull_in_thread(client, version: int) -> dict:
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = client.pull(version)
        except Exception as exc:  # collected for the assertions
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    out["thread"] = thread
    return out


def test_a_deadline_with_two_shards_names_the_rank_that_did_not_push(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=2, shards=2, timeout_s=0.5)
    fast, slow = make_client(server, 0), make_client(server, 1)
    fast.connect()
    slow.connect()
    fast.push(0, torch.ones(N))
    with pytest.raises(PSTimeoutError, match=r"rank\(s\) 1 had not pushed step 0.*ps\.timeout_s"):
        fast.pull(1)
    assert server.version == 0


def test_a_failed_rank_is_the_one_root_cause_on_every_shard(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=2, shards=2)
    ok, bad = make_client(server, 0), make_client(server, 1)
    ok.connect()
    bad.connect()
    ok.push(0, torch.ones(N))
    waiting = _pull_in_thread(ok, 1)
    bad.fail("CUDA error: out of memory", "tail")
    waiting["thread"].join(10)
    assert isinstance(waiting["error"], PSError) and "rank 1" in str(waiting["error"])
    assert "out of memory" in str(waiting["error"])
    assert list(server.root_failures) == [1] and server.failures[1].log_tail == "tail"
    assert server.aborted


def test_a_rank_that_drops_one_shard_fails_its_peers_on_the_other(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=2, shards=2)
    ok, bad = make_client(server, 0), make_client(server, 1)
    ok.connect()
    bad.connect()
    ok.push(0, torch.ones(N))
    waiting = _pull_in_thread(ok, 1)
    bad._links[1].channel.close()  # only shard 1 sees the drop; shard 0's waiter must wake too
    waiting["thread"].join(10)
    assert isinstance(waiting["error"], PSError) and "rank 1" in str(waiting["error"])
    assert list(server.root_failures) == [1]


def test_state_dict_of_two_shards_loads_into_one(make_server, make_client):
    torch.manual_seed(1)
    opt = OptimizerSpec(name="sgd", lr=0.5, momentum=0.9)
    two = make_server(torch.randn(N), world_size=1, shards=2, optimizer=opt)
    c = make_client(two, 0)
    c.connect()
    _steps(two, c, "sync", [torch.randn(N) for _ in range(2)])
    state = two.state_dict()
    assert state["version"] == 2 and state["params"].shape == (N,)
    assert state["optimizer"]["state"][0]["momentum_buffer"].shape == (N,)
    one = make_server(torch.zeros(N), world_size=1, shards=1, optimizer=opt)
    one.load_state_dict(state)
    three = make_server(torch.zeros(N), world_size=1, shards=3, optimizer=opt)
    three.load_state_dict(state)
    grad = torch.randn(N)
    for server, client in ((one, None), (three, None), (two, c)):
        client = client or make_client(server, 0)
        client.connect()
        client.push(2, grad)
        client.pull(3)
    assert torch.equal(one.parameters(), two.parameters())
    assert torch.equal(three.parameters(), two.parameters())
