"""The synchronous parameter server over real sockets: averaging, optimizers, auth, hostile peers,
deadlines, and failing fast when a rank dies, fails or finishes early."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable

import pytest
import torch

from pipeline.errors import AuthenticationError, PSError, PSTimeoutError, WorkerFailure
from pipeline.ps import OptimizerSpec, ParameterServer, PSClient
from pipeline.ps.state import core
from pipeline.ps.transport.protocol import Channel, Header, MsgType
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import HEADER_SIZE, MAGIC
from pipeline.wire.handshake import auth_mac
from pipeline.wire.pending import PENDING_CAP

TIMEOUT_S = 1.5
JOIN_S = 10.0  # a hung thread fails the test instead of hanging the suite


def run_ranks(fns: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Run one callable per rank in its own thread; return {rank: result or the exception}."""
    results: dict[int, Any] = {}

    def target(rank: int, fn: Callable[[], Any]) -> None:
        try:
            results[rank] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r, f), daemon=True) for r, f in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a worker thread hung"
    return results


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll a condition (no fixed sleeps); fails the test after JOIN_S."""
    deadline = time.monotonic() + JOIN_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def raw_channel(server: ParameterServer, secret: bytes, *, rank: int = 0,
                generation: int = 1) -> Channel:
    """A hand-driven, authenticated connection, for sending frames PSClient never would."""
    sock = socket.create_connection(server.address, timeout=TIMEOUT_S)
    channel = Channel(sock)
    header = channel.recv_header(None)
    assert header.type is MsgType.CHALLENGE
    nonce = channel.recv_bytes(header, None)
    channel.send_bytes(MsgType.AUTH, auth_mac(secret, nonce, rank, generation),
                       generation=generation, rank=rank, timeout=TIMEOUT_S)
    ours = b"c" * 32  # the mutual half: the server proves itself over our nonce before WELCOME
    channel.send_bytes(MsgType.CHALLENGE, ours, generation=generation, rank=rank, timeout=TIMEOUT_S)
    header = channel.recv_header(None)
    assert header.type is MsgType.AUTH, header
    assert channel.recv_bytes(header, None) == auth_mac(secret, ours, header.rank, generation)
    header = channel.recv_header(None)
    assert header.type is MsgType.WELCOME, header
    info = channel.recv_json(header, None)
    channel.max_elements = info["num_params"]
    return channel


def grad_for(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(c: PSClient, steps: int, n: int) -> tuple[int, torch.Tensor]:
    """The worker loop in miniature: pull the version for this step, push its gradient."""
    c.connect()
    for step in range(steps):
        version, _ = c.pull(step)
        assert version == step
        c.push(step, grad_for(c.rank, step, n))
    version, params = c.pull(steps)
    result = (version, params.clone())
    c.finish()
    return result


def waiting_pull(c: PSClient) -> Exception | tuple:
    """Rank pushes step 0 and waits for version 1: the waiter the failure tests wake up."""
    c.push(0, torch.ones(6))
    return c.pull(1)


def wait_for_waiter(server: ParameterServer, rank: int = 0) -> None:
    wait_until(lambda: rank in server.stats["last_step_by_rank"]
               and server.stats["requests_in_flight"] >= 1, f"rank {rank} to wait in PULL")


# -- the happy path -------------------------------------------------------------------------------
def test_push_pull_round_trip_two_ranks(make_server, make_client) -> None:
    server = make_server(world_size=2)
    results = run_ranks({r: (lambda r=r: train(make_client(server, r), 3, 6)) for r in (0, 1)})
    (v0, p0), (v1, p1) = results[0], results[1]
    assert v0 == v1 == server.version == 3
    assert torch.equal(p0, p1) and torch.equal(p0, server.parameters())
    assert server.finished_ranks == {0, 1} and server.failures == {}
    stats = server.stats
    assert stats["pushes_applied"] == 6 and stats["last_step_by_rank"] == {0: 2, 1: 2}
    assert stats["bytes_received"] > 6 * 24 and stats["bytes_sent"] > 8 * 24
    assert stats["rejected_connections"] == 0


@pytest.mark.parametrize("threads", [1, 0])
def test_a_server_steps_with_ps_server_threads(make_server, make_client, monkeypatch, threads) -> None:
    seen: list[int] = []
    step = core.ShardCore.optimizer_step

    def recording_step(self, grad_sum, divisor):
        seen.append(torch.get_num_threads())  # ps.server_threads (pipeline.ps.server.tensor_threads), in the
        # server thread that applies the step; the driver's own count stays
        return step(self, grad_sum, divisor)

    monkeypatch.setattr(core.ShardCore, "optimizer_step", recording_step)
    server = make_server(world_size=2, server_threads=threads)
    run_ranks({r: (lambda r=r: train(make_client(server, r), 3, 6)) for r in (0, 1)})
    assert seen == [threads or torch.get_num_threads()] * 3


@pytest.mark.parametrize("spec", [
    OptimizerSpec("sgd", lr=1.0),
    OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    OptimizerSpec("adam", lr=0.01, betas=(0.8, 0.99), weight_decay=0.001),
], ids=["sgd", "sgd-momentum", "adam"])
def test_sync_step_equals_torch_optimizer_on_the_mean_gradient(make_server, make_client, spec) -> None:
    n, world, steps = 50, 3, 3
    initial = torch.randn(n, generator=torch.Generator().manual_seed(7))
    server = make_server(initial, world_size=world, optimizer=spec)
    run_ranks({r: (lambda r=r: train(make_client(server, r), steps, n)) for r in range(world)})

    ref = initial.clone().requires_grad_(True)
    opt = (torch.optim.SGD([ref], lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
           if spec.name == "sgd" else
           torch.optim.Adam([ref], lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay))
    for step in range(steps):
        ref.grad = torch.stack([grad_for(r, step, n) for r in range(world)]).mean(0)
        opt.step()
    torch.testing.assert_close(server.parameters(), ref.detach())


def test_sgd_lr1_is_old_minus_mean(make_server, make_client) -> None:
    initial = torch.arange(6, dtype=torch.float32)
    server = make_server(initial, world_size=2)
    grads = {0: torch.tensor([1.0, 2, 3, 4, 5, 6]), 1: torch.tensor([3.0, 2, 1, 0, -1, -2])}

    def one_step(rank: int) -> tuple[int, torch.Tensor]:
        with make_client(server, rank) as c:
            c.push(0, grads[rank])
            version, params = c.pull(1)
            c.finish()
            return version, params.clone()

    results = run_ranks({r: (lambda r=r: one_step(r)) for r in (0, 1)})
    expected = initial - (grads[0] + grads[1]) / 2
    for version, params in results.values():
        assert version == 1 and torch.equal(params, expected)


# -- authentication and hostile peers -------------------------------------------------------------
def test_wrong_secret_is_rejected_and_server_keeps_serving(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with pytest.raises(AuthenticationError, match="authentication failed for rank 0"):
        make_client(server, 0, secret=b"x" * 32).connect()
    assert server.stats["rejected_connections"] == 1
    version, _ = run_ranks({0: lambda: train(make_client(server, 0), 2, 6)})[0]
    assert version == 2 and server.failures == {}


def _expect_closed(sock: socket.socket) -> None:
    """Drain until the server closes the connection (it may send CHALLENGE/ERROR first). A reset counts as
    closed: a server that drops a hostile peer while unread bytes are pending makes the kernel send RST."""
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


def test_garbage_and_truncated_frames_do_not_kill_the_server(make_server, make_client) -> None:
    server = make_server(world_size=1)
    hostile = [
        b"GET / HTTP/1.1\r\nHost: driver\r\n\r\n" + b"x" * 64,  # bad magic
        MAGIC + b"\x01",  # truncated header
        b"",  # connect and hang up
        Header(MsgType.AUTH, 1, 0, length=1 << 40).pack(),  # bad size for AUTH
        Header(MsgType.PUSH, 1, 0, step=0, dtype=1, count=1 << 30, length=1 << 32).pack(),  # huge push
        Header(MsgType.AUTH, 1, 0, length=32).pack() + b"\0" * 10,  # truncated payload
    ]
    for data in hostile:
        with socket.create_connection(server.address, timeout=5) as sock:
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the server may hang up on the garbage before we finish sending it
                pass
            _expect_closed(sock)
    wait_until(lambda: server.stats["rejected_connections"] == len(hostile), "all rejections")
    version, _ = run_ranks({0: lambda: train(make_client(server, 0), 2, 6)})[0]
    assert version == 2 and server.failures == {}


def test_silent_connection_is_dropped_at_the_handshake_deadline(make_server) -> None:
    server = make_server(world_size=1, timeout_s=0.2)
    with socket.create_connection(server.address, timeout=5) as sock:
        _expect_closed(sock)  # the server gave up waiting for AUTH
    assert server.stats["rejected_connections"] == 1


def test_connection_flood_is_capped(make_server) -> None:
    server = make_server(world_size=1)  # pending cap: PENDING_CAP unauthenticated connections, oldest evicted
    socks = [socket.create_connection(server.address, timeout=5) for _ in range(PENDING_CAP + 2)]
    try:
        wait_until(lambda: server.stats["rejected_connections"] >= 2, "connections over the cap")
    finally:
        for s in socks:
            s.close()


def test_malformed_frame_after_auth_drops_that_rank_only(make_server, secret) -> None:
    server = make_server(world_size=1)
    channel = raw_channel(server, secret, rank=0)
    channel.sock.sendall(b"\0" * 48)
    header = channel.recv_header(None)
    assert header.type is MsgType.ERROR
    assert "bad magic" in channel.recv_json(header, None)["error"]
    channel.close()
    wait_until(lambda: 0 in server.failures, "rank 0 recorded as failed")
    assert "malformed frame" in server.failures[0].error
    assert server.stats["protocol_errors"] == 1


# -- generations and ranks --------------------------------------------------------------------------
def test_wrong_generation_is_rejected_at_the_handshake(make_server, make_client) -> None:
    server = make_server(world_size=1, generation=2)
    with pytest.raises(AuthenticationError, match="generation 1 but the server is at generation 2"):
        make_client(server, 0, generation=1).connect()
    assert server.stats["rejected_connections"] == 1
    with make_client(server, 0, generation=2) as c:
        assert c.connect().num_params == 6


def test_frame_with_wrong_generation_is_rejected(make_server, secret) -> None:
    server = make_server(world_size=1, generation=2)
    channel = raw_channel(server, secret, rank=0, generation=2)
    channel.send_empty(MsgType.PULL, generation=3, rank=0, step=0, timeout=TIMEOUT_S)
    header = channel.recv_header(None)
    assert header.type is MsgType.ERROR
    assert "generation 3" in channel.recv_json(header, None)["error"]
    channel.close()
    wait_until(lambda: 0 in server.failures, "rank 0 recorded as failed")


def test_duplicate_rank_connection_is_rejected(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with make_client(server, 0) as first:
        with pytest.raises(AuthenticationError, match="rank 0 is already connected"):
            make_client(server, 0).connect()
        first.push(0, torch.zeros(6))
        assert first.pull(1)[0] == 1
        first.finish()
    assert server.stats["rejected_connections"] == 1
    with pytest.raises(AuthenticationError, match="already finished"):
        make_client(server, 0).connect()


def test_rank_out_of_range_is_rejected(make_server, make_client) -> None:
    server = make_server(world_size=2)
    with pytest.raises(AuthenticationError, match="rank 2 is out of range for world_size 2"):
        make_client(server, 2).connect()


# -- refused requests keep the connection -----------------------------------------------------------
def test_wrong_step_names_rank_step_and_version(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with make_client(server, 0) as c:
        with pytest.raises(PSError, match="rank 0 pushed a gradient for step 5 but the server is at version 0"):
            c.push(5, torch.zeros(6))
        c.push(0, torch.zeros(6))  # the connection is still usable
        with pytest.raises(PSError, match="step -1 but the server is at version 1"):
            c.push(-1, torch.zeros(6))
        assert c.pull(1)[0] == 1
        c.finish()


def test_double_push_and_unreachable_pull_are_refused_at_once(make_server, make_client) -> None:
    server = make_server(world_size=2)
    with make_client(server, 0) as c:
        with pytest.raises(PSError, match="has not pushed step 0"):
            c.pull(1)  # would deadlock on itself: refused immediately, not after the deadline
        c.push(0, torch.zeros(6))
        with pytest.raises(PSError, match="rank 0 already pushed a gradient for step 0"):
            c.push(0, torch.zeros(6))
        with pytest.raises(PSError, match="asked for version 2"):
            c.pull(2)
        c.finish()
    assert server.stats["pushes_applied"] == 1


def test_non_finite_gradient_is_refused(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with make_client(server, 0) as c:
        with pytest.raises(PSError, match="NaN/Inf for step 0"):
            c.push(0, torch.tensor([0, 1, float("nan"), 0, 0, 0.0]))
        c.finish()
    assert server.version == 0 and torch.isfinite(server.parameters()).all()


# -- deadlines and failing fast -----------------------------------------------------------------------
def test_rank_that_never_pushes_times_out_naming_it(make_server, make_client) -> None:
    server = make_server(world_size=3, timeout_s=0.3)
    with make_client(server, 0) as c0, make_client(server, 1) as c1:
        c0.push(0, torch.ones(6))
        with pytest.raises(PSTimeoutError) as info:
            c0.pull(1)
        text = str(info.value)
        assert "rank(s) 1, 2 had not pushed step 0" in text
        assert "rank(s) 2 never connected" in text and "ps.timeout_s" in text
        assert "version 1" in text
        c1.close()


@pytest.mark.parametrize("how", ["disconnect", "fail", "finish"])
def test_dead_failed_or_finished_peer_fails_the_waiter_fast(make_server, make_client, how, background) -> None:
    # A long deadline: only failing fast (not the timeout) can end the wait within the test.
    server = make_server(world_size=2, timeout_s=30)
    c0, c1 = make_client(server, 0), make_client(server, 1)
    c0.connect()
    c1.connect()
    waiter = background(lambda: waiting_pull(c0))
    wait_for_waiter(server)
    if how == "disconnect":
        c1.close()
    elif how == "fail":
        c1.fail("CUDA out of memory", log_tail="line 1\nline 2")
    else:
        c1.finish()
    error = waiter.outcome()
    assert isinstance(error, PSError) and not isinstance(error, PSTimeoutError), error
    assert "rank(s) 1" in str(error)
    if how == "finish":
        assert "finished without pushing step 0" in str(error)
        assert server.finished_ranks == {1} and server.failures == {}
    else:
        assert set(server.failures) == {1}
    if how == "fail":
        assert "CUDA out of memory" in str(error)
        assert server.failures[1] == WorkerFailure(1, "CUDA out of memory", "line 1\nline 2")
    if how == "disconnect":
        assert "before FINISH" in server.failures[1].error
    c0.close()


def test_requests_after_a_peer_failed_are_refused(make_server, make_client) -> None:
    server = make_server(world_size=2)
    with make_client(server, 0) as c0, make_client(server, 1) as c1:
        c1.fail("boom")
        with pytest.raises(PSError, match=r"rank\(s\) 1 failed.*boom"):
            c0.push(0, torch.ones(6))
    # rank 0 then dropped without FINISH: recorded, but pointing at the root cause
    wait_until(lambda: 0 in server.failures, "rank 0's drop")
    assert "after rank(s) 1 had failed" in server.failures[0].error


def test_server_fail_wakes_waiters_and_refuses_newcomers(make_server, make_client, background) -> None:
    server = make_server(world_size=2, timeout_s=30)
    c0 = make_client(server, 0)
    c0.connect()
    waiter = background(lambda: waiting_pull(c0))
    wait_for_waiter(server)
    server.fail("executor lost; the driver aborts this attempt")
    error = waiter.outcome()
    assert isinstance(error, PSError) and "executor lost" in str(error)
    with pytest.raises(AuthenticationError, match="executor lost"):
        make_client(server, 1).connect()
    c0.close()


def test_close_wakes_waiters_and_is_idempotent(make_server, make_client, background) -> None:
    server = make_server(world_size=2, timeout_s=30)
    c0 = make_client(server, 0)
    c0.connect()
    before = server.stats["bytes_received"]
    waiter = background(lambda: waiting_pull(c0))
    # Not wait_for_waiter: the PUSH itself counts as in flight while it is handled, so close() could
    # come before the PULL is sent (then the client sees a closed socket, not the shutdown). Wait until
    # the PULL's header has been read too: PUSH header + 6 floats + PULL header.
    wait_until(lambda: server.stats["bytes_received"] - before >= 2 * HEADER_SIZE + 6 * 4
               and server.stats["requests_in_flight"] >= 1, "rank 0's PULL to reach the server")
    server.close()
    server.close()
    error = waiter.outcome()
    assert isinstance(error, PSError) and "shutting down" in str(error)
    assert server.failures == {}  # a shutdown is not a worker failure
    c0.close()


# -- metrics, generations, checkpoints --------------------------------------------------------------
def test_metrics_reach_the_callback_and_a_failing_callback_is_contained(make_server, make_client, caplog):
    seen: list[tuple[int, dict]] = []

    def on_metrics(rank: int, metrics: dict) -> None:
        seen.append((rank, metrics))
        if metrics.get("explode"):
            raise RuntimeError("tracking backend down")

    server = make_server(world_size=1, on_metrics=on_metrics)
    with make_client(server, 0) as c, caplog.at_level(logging.ERROR, logger="pipeline.ps.server.parameter_server"):
        c.report({"loss": 0.25, "epoch": 1})
        c.report({"explode": True})
        c.report({"loss": float("nan")})
        c.push(0, torch.zeros(6))
        c.finish()
    assert seen[0] == (0, {"loss": 0.25, "epoch": 1}) and len(seen) == 3
    assert any("on_metrics callback failed for rank 0" in r.getMessage() for r in caplog.records)
    assert server.failures == {} and server.version == 1


def test_new_generation_keeps_state_and_cuts_the_old_attempt(make_server, make_client) -> None:
    server = make_server(world_size=2)
    run_ranks({r: (lambda r=r: train(make_client(server, r), 1, 6)) for r in (0, 1)})
    params_after_1 = server.parameters()
    stale = make_client(server, 0)
    with pytest.raises(AuthenticationError, match="already finished"):
        stale.connect()
    assert server.new_generation() == 2
    assert server.failures == {} and server.finished_ranks == set() and server.version == 1
    with pytest.raises(AuthenticationError, match="generation 1 but the server is at generation 2"):
        stale.connect()

    def resume(rank: int) -> int:
        with make_client(server, rank, generation=2) as c:
            version, params = c.pull(0)
            assert torch.equal(params, params_after_1)
            c.push(version, torch.ones(6))
            result = c.pull(version + 1)[0]
            c.finish()
            return result

    assert run_ranks({r: (lambda r=r: resume(r)) for r in (0, 1)}) == {0: 2, 1: 2}


def test_new_generation_disconnects_live_old_connections(make_server, make_client) -> None:
    server = make_server(world_size=2)
    with make_client(server, 0) as old:
        server.new_generation(5)
        with pytest.raises(PSError):
            old.push(0, torch.ones(6))
    assert server.failures == {}  # being cut by a new generation is not a failure


def test_state_dict_round_trip_continues_identically(make_server, make_client) -> None:
    spec = OptimizerSpec("adam", lr=0.05)
    a = make_server(world_size=1, optimizer=spec)
    run_ranks({0: lambda: train(make_client(a, 0), 2, 6)})
    b = make_server(torch.zeros(6), world_size=1, optimizer=spec)
    b.load_state_dict(a.state_dict())
    assert b.version == 2 and torch.equal(b.parameters(), a.parameters())
    a.new_generation()  # rank 0 already finished on `a`; a new attempt lets it connect again
    for server in (a, b):
        with make_client(server, 0, generation=server.generation) as c:
            c.push(2, torch.full((6,), 0.5))
            c.finish()
    assert a.version == b.version == 3
    assert torch.equal(a.parameters(), b.parameters())


@pytest.mark.parametrize("kwargs, match", [
    ({"secret": b"short"}, "at least 16"),
    ({"world_size": 0}, "world_size"),
    ({"timeout_s": 0}, "ps.timeout_s"),
    ({"initial": torch.empty(0)}, "non-empty"),
    ({"initial": torch.tensor([float("inf")])}, "NaN or Inf"),
    ({"host": ""}, "explicit host"),
])
def test_constructor_validates(secret, server_factory, kwargs, match) -> None:
    args = {"initial": torch.zeros(3), "world_size": 1, "secret": secret,
            "optimizer": OptimizerSpec(), "host": "127.0.0.1", **kwargs}
    with pytest.raises(PSError, match=match):
        server_factory(args.pop("initial"), **args)


def test_address_binds_loopback_with_an_os_chosen_port(make_server) -> None:
    host, port = make_server(world_size=1).address
    assert host == "127.0.0.1" and port > 0


def test_load_state_dict_checks_the_optimizer_and_keeps_current_hyperparameters(make_server) -> None:
    sgd = make_server(world_size=1, optimizer=OptimizerSpec("sgd", lr=0.5, momentum=0.9))
    state = sgd.state_dict()
    assert state["optimizer_spec"]["name"] == "sgd" and state["version"] == 0
    adam = make_server(world_size=1, optimizer=OptimizerSpec("adam"))
    with pytest.raises(PSError, match="trained with optimizer 'sgd' but train.optimizer is 'adam'"):
        adam.load_state_dict(state)
    lower_lr = make_server(world_size=1, optimizer=OptimizerSpec("sgd", lr=0.01, momentum=0.5))
    lower_lr.load_state_dict(state)
    group = lower_lr.state_dict()["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.01 and group["momentum"] == 0.5
    with pytest.raises(PSError, match="do not match"):
        lower_lr.load_state_dict({**state, "params": torch.zeros(3)})


def test_finite_check_is_exact_even_when_the_sum_overflows() -> None:
    from pipeline.ps.modes.compression import all_finite as _all_finite

    assert _all_finite(torch.tensor([3e38, 3e38, -1.0]))  # the sum overflows, the values are finite
    assert not _all_finite(torch.tensor([0.0, float("inf")]))
    assert not _all_finite(torch.tensor([float("nan"), 1.0]))
    assert not _all_finite(torch.tensor([float("inf"), float("-inf")]))


@pytest.mark.parametrize("extra, retryable", [
    ({}, True),  # a worker that does not say: retryable, as before the flag existed
    ({"retryable": False}, False),
    ({"retryable": True}, True),
    # Only a JSON false means "do not retry": the network's types are not trusted.
    ({"retryable": "false"}, True),
    ({"retryable": 0}, True),
    ({"retryable": None}, True),
    ({"retryable": [False]}, True),
])
def test_fail_frame_retryable_flag_is_validated(make_server, secret, extra, retryable) -> None:
    server = make_server(world_size=2)
    channel = raw_channel(server, secret, rank=1)
    try:
        channel.send_json(MsgType.FAIL, {"error": "boom", "log_tail": "t", **extra}, generation=1, rank=1,
                          step=4, timeout=TIMEOUT_S)
        header = channel.recv_header(deadline_after(TIMEOUT_S))
        assert (header.type, header.step) == (MsgType.ACK, 4)
        assert server.failures[1] == WorkerFailure(1, "boom", "t", retryable=retryable)
        assert server.root_failures[1].retryable is retryable
    finally:
        channel.close()
