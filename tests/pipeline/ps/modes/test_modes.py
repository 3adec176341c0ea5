"""Consistency modes and push compression against a real server, clients in real threads."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from pipeline.errors import PSError
from pipeline.ps import OptimizerSpec, ParameterServer
from pipeline.ps.modes.compression import Compressor
from pipeline.ps.modes.consistency import Consistency, averaging_rounds, expected_version, resume_step
from pipeline.ps.transport.protocol import Channel, MsgType
from pipeline.wire.handshake import auth_mac

N = 6


def grad_for(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank))


def raw_client(server: ParameterServer, secret: bytes, *, rank: int) -> Channel:
    """A hand-driven, authenticated connection, for frames PSClient never sends."""
    sock = socket.create_connection(server.address, timeout=5)
    channel = Channel(sock)
    header = channel.recv_header(None)
    nonce = channel.recv_bytes(header, None)
    channel.send_bytes(MsgType.AUTH, auth_mac(secret, nonce, rank, 1), generation=1, rank=rank, timeout=5)
    channel.send_bytes(MsgType.CHALLENGE, b"c" * 32, generation=1, rank=rank, timeout=5)  # mutual
    header = channel.recv_header(None)
    assert header.type is MsgType.AUTH, header
    channel.recv_bytes(header, None)
    header = channel.recv_header(None)
    assert header.type is MsgType.WELCOME, header
    channel.max_elements = int(channel.recv_json(header, None)["num_params"])
    return channel


def _wait_for(predicate, what: str, deadline_s: float = 10.0) -> None:
    """Poll server state with a deadline (a wait, not a timing assert)."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_ssp_blocks_the_fast_rank_at_exactly_the_bound(make_server, make_client, background):
    server = make_server(world_size=2, consistency=Consistency("ssp", staleness=2), timeout_s=10)
    fast, slow = make_client(server, 0, timeout_s=10), make_client(server, 1, timeout_s=10)
    fast.connect(), slow.connect()
    assert fast.info.mode == "ssp" and fast.info.clock == 0
    for clock in range(2):  # clocks 0 and 1: within the bound, never blocked
        fast.push(clock, grad_for(0, clock, N))
        version, _ = fast.pull(clock + 1)
        assert version == 0
    fast.push(2, grad_for(0, 2, N))
    blocked = background(lambda: fast.pull(3))  # would be 3 clocks ahead of the slowest: must wait
    _wait_for(lambda: server.waiting_ranks == {0: 3}, "rank 0 to block on clock 3")
    assert server.version == 0 and server.waiting_ranks == {0: 3}
    slow.push(0, grad_for(1, 0, N))  # the slowest completes clock 0: version 1, lead 3 - 1 = 2
    version, _ = blocked.result()
    assert version == 1 and 3 - version == 2
    assert server.stats["blocked_pulls"] == 1
    with pytest.raises(PSError, match="ps.staleness=2"):  # a rank cannot skip the pull to run ahead
        fast.push(3, grad_for(0, 3, N))
        fast.push(4, grad_for(0, 4, N))


def test_ssp_with_zero_staleness_applies_exactly_what_sync_applies(make_server, make_client, background):
    results = {}
    for mode in ("sync", "ssp"):
        server = make_server(torch.zeros(N), world_size=2, consistency=Consistency(mode, staleness=0),
                             optimizer=OptimizerSpec(lr=0.1, momentum=0.9))
        clients = [make_client(server, r) for r in range(2)]
        for c in clients:
            c.connect()
        for step in range(4):
            for c in clients:
                c.push(step, grad_for(c.rank, step, N))
            waiters = [background(lambda c=c: c.pull(step + 1)) for c in clients]
            assert {w.result()[0] for w in waiters} == {step + 1}
        results[mode] = server.parameters()
    assert torch.equal(results["sync"], results["ssp"])


def test_async_applies_each_push_at_once_and_reports_its_staleness(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=2, consistency=Consistency("async"),
                         optimizer=OptimizerSpec(lr=1.0))
    a, b = make_client(server, 0), make_client(server, 1)
    a.connect(), b.connect()
    assert a.pull(0)[0] == 0 and b.pull(0)[0] == 0
    assert a.push(0, torch.ones(N)) == 0  # applied to version 0: fresh
    assert server.version == 1  # no waiting for rank 1
    assert b.push(0, torch.full((N,), 2.0)) == 1  # computed on version 0, applied to 1: stale by 1
    assert torch.equal(server.parameters(), torch.full((N,), -3.0))  # two plain SGD steps, lr 1
    stats = server.stats
    assert stats["staleness_max"] == 1 and stats["staleness_mean"] == 0.5
    assert stats["clock_by_rank"] == {0: 1, 1: 1}
    with pytest.raises(PSError, match="next step is 1"):  # at most once, in order
        a.push(0, torch.ones(N))


def test_average_mode_adds_the_mean_delta_of_the_replicas(make_server, make_client):
    server = make_server(torch.zeros(N), world_size=2, consistency=Consistency("average", sync_every=3))
    a, b = make_client(server, 0), make_client(server, 1)
    a.connect(), b.connect()
    a.push(0, torch.full((N,), 1.0))
    b.push(0, torch.full((N,), 3.0))
    version, params = a.pull(1)
    assert version == 1 and torch.equal(params, torch.full((N,), 2.0))  # no optimizer on the server


def test_expected_versions_per_mode():
    assert expected_version(Consistency("sync"), 10, 4) == 10
    assert expected_version(Consistency("ssp", staleness=3), 10, 4) == 10
    assert expected_version(Consistency("async"), 10, 4) == 40
    assert expected_version(Consistency("average", sync_every=4), 10, 4) == averaging_rounds(10, 4) == 3


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_precision_pushes_halve_the_bytes_the_server_counts(make_server, make_client, compression):
    payload = {}
    params = {}
    for comp in ("none", compression):
        server = make_server(torch.zeros(1000), world_size=1, compression=comp)
        c = make_client(server, 0)
        c.connect()
        for step in range(3):
            c.push(step, torch.full((1000,), 0.5))  # exactly representable in fp16 and bf16
            c.pull(step + 1)
        payload[comp] = server.stats["push_payload_bytes"]
        params[comp] = server.parameters()
    assert payload["none"] == 3 * 1000 * 4
    assert payload[compression] * 2 == payload["none"]
    assert torch.equal(params["none"], params[compression])  # fp32 accumulation on the server


def test_topk_sends_k_entries_and_keeps_the_rest_as_residual(make_server, make_client):
    server = make_server(torch.zeros(100), world_size=1, compression="topk", topk_ratio=0.1,
                         optimizer=OptimizerSpec(lr=1.0))
    c = make_client(server, 0)
    c.connect()
    grads = [torch.randn(100, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    for step, g in enumerate(grads):
        c.push(step, g)
        c.pull(step + 1)
    assert server.stats["push_payload_bytes"] == 5 * 10 * 8  # 10 int32 indices + 10 fp32 values per push
    # Error feedback: what the server applied plus what the worker still holds is every gradient.
    applied = -server.parameters()
    assert torch.allclose(applied + c.compressor.residual, torch.stack(grads).sum(0), atol=1e-5)


def test_topk_encoder_sends_the_largest_entries():
    comp = Compressor("topk", 8, ratio=0.25)
    encoded = comp.encode(torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, 0.0, 0.0, 0.3]))
    words = torch.frombuffer(bytearray(encoded.payload), dtype=torch.int32)
    assert encoded.count == 2 and sorted(words[:2].tolist()) == [1, 3]
    assert torch.equal(comp.residual, torch.tensor([0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.3]))


def test_a_topk_push_with_an_index_out_of_range_is_a_protocol_error(make_server, secret):
    from pipeline.ps.transport.protocol import DType, Header, MsgType

    server = make_server(torch.zeros(10), world_size=1, compression="topk", topk_ratio=0.5)
    channel = raw_client(server, secret, rank=0)
    payload = torch.tensor([3, 10, 0, 0], dtype=torch.int32)  # index 10 of 10 parameters
    channel.send(Header(MsgType.PUSH, 1, 0, 0, DType.SPARSE_F32, 2, 16),
                 memoryview(payload.numpy()).cast("B"), timeout=2)
    header = channel.recv_header(time.monotonic() + 5)
    body = channel.recv_json(header, time.monotonic() + 5)
    assert body["kind"] == "protocol" and "outside [0, 10)" in body["error"]
    assert torch.equal(server.parameters(), torch.zeros(10))


def test_a_server_accepts_only_its_configured_push_dtype(make_server, make_client):
    server = make_server(world_size=1, compression="fp16")
    c = make_client(server, 0)
    c.connect()
    c._links[0].compressor = Compressor("none", N)  # a worker that ignores the server's compression
    with pytest.raises(PSError, match="FLOAT32 is not accepted"):
        c.push(0, torch.ones(N))


def test_resume_step_mirrors_where_each_mode_restarts_a_rank():
    state = {"version": 7, "clocks": {0: 12, 1: 9}}
    assert resume_step(Consistency("sync"), state, 1, 100) == 7
    assert resume_step(Consistency("ssp", staleness=2), state, 1, 100) == 7  # clocks restart at the version
    assert [resume_step(Consistency("async"), state, r, 100) for r in (0, 1, 2)] == [12, 9, 0]  # own clock
    assert resume_step(Consistency("average", sync_every=4), state, 0, 100) == 28  # after the last merged round
    assert resume_step(Consistency("average", sync_every=4), state, 0, 25) == 25  # the last round is short
