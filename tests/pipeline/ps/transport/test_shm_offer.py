"""Workers on the PS's host move their payloads through shared-memory rings (ps.shared_memory_mb), and in
sync mode read the parameters from the server's sealed page: the same parameters as over TCP, bit for
bit; no segment file left behind, whatever the worker does; none with the rings off; a request out of
turn is refused."""
from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import torch

from pipeline.errors import AuthenticationError
from pipeline.ps.transport import shm_offer
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.transport.protocol import MsgType
from pipeline.wire import shared_page, shm
from pipeline.wire.deadline import deadline_after

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory rings need x86-64 Linux")

N = 60_000  # 240 KB of fp32: every PUSH and PARAMS is above the rings' 64 KB threshold


def _segments() -> set[str]:
    return set(glob.glob(os.path.join(shm.SHM_DIR, "shardline-*")))


def _train(make_server, make_client, steps: int, **server_options) -> tuple[torch.Tensor, list]:
    init = torch.randn(N, generator=torch.Generator().manual_seed(0))
    server = make_server(init.clone(), world_size=2, **server_options)
    clients = [make_client(server, rank) for rank in range(2)]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            client = clients[rank]
            client.connect()
            version, _ = client.pull(0)
            g = torch.Generator().manual_seed(rank + 1)
            for step in range(version, version + steps):
                client.push_pull(step, torch.randn(N, generator=g))
            client.finish()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return server.parameters().clone(), clients


def test_rings_carry_the_payloads_and_training_matches_tcp_bit_for_bit(make_server, make_client) -> None:
    before = _segments()
    over_tcp, tcp_clients = _train(make_server, make_client, 6, shared_memory_bytes=0)
    over_rings, ring_clients = _train(make_server, make_client, 6)
    assert torch.equal(over_tcp, over_rings)
    assert all(c._links == [] for c in ring_clients)  # finished: closed
    assert _segments() == before  # unlinked once answered: nothing left in /dev/shm


def test_ssp_and_average_train_through_the_rings_bit_for_bit_as_over_tcp(make_server, make_client) -> None:
    for consistency in (Consistency(mode="ssp", staleness=1), Consistency(mode="average", sync_every=1)):
        over_tcp, _ = _train(make_server, make_client, 4, shared_memory_bytes=0, consistency=consistency)
        over_rings, clients = _train(make_server, make_client, 4, consistency=consistency)
        assert torch.equal(over_tcp, over_rings), consistency.mode


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_connected_worker_uses_its_rings_and_tcp_workers_do_not(make_server, make_client, mode) -> None:
    init = torch.zeros(N)
    for cap, expect_rings in ((256 << 20, True), (0, False)):
        server = make_server(init.clone(), world_size=1, shared_memory_bytes=cap,
                             consistency=Consistency(mode=mode, staleness=1))
        client = make_client(server, 0)
        client.connect()
        client.pull(0)
        client.push_pull(0, torch.ones(N))
        channel = client._links[0].channel
        in_page = expect_rings and mode == "sync"  # sync: PARAMS lie in the server's page, never copied
        assert (channel.shm is not None) is expect_rings and (channel.params_page is not None) is in_page
        if expect_rings:  # the reply ring holds two PARAMS only where PARAMS come through it
            assert channel.shm.into.size >= (1 if in_page else 2) * 4 * N + shm_offer.SLACK_BYTES
            assert channel.shm.into.size < (1 if in_page else 2) * 4 * N + shm_offer.SLACK_BYTES + 64
            assert channel.shm.out.size < 4 * N + shm_offer.SLACK_BYTES + 64  # pushes: one slice
        assert (channel.shm_bytes_sent, channel.shm_bytes_received) == \
            ((4 * N, 0 if in_page else 2 * 4 * N) if expect_rings else (0, 0))  # one push; two PARAMS
        client.finish()


def test_connections_beyond_the_shards_budget_stay_on_tcp_and_a_closed_one_gives_it_back(
        make_server, make_client) -> None:
    # both rings of one connection (sync mode: the server's parameter page, so one slice each), its slot
    one_connection = 2 * (4 * N + shm_offer.SLACK_BYTES) + 4 * N
    server = make_server(torch.zeros(N), world_size=2, shared_memory_bytes=one_connection + 1000)
    first, second = make_client(server, 0), make_client(server, 1)
    first.connect()
    second.connect()
    shard = server._shards[0]
    assert first._links[0].channel.shm is not None and second._links[0].channel.shm is None, \
        (type(shard).__name__, shard._shm_used, shard._shm_cap, one_connection)
    assert shard._shm_used == one_connection
    first.close()  # its connection ends: its rings and their budget go
    deadline = deadline_after(5)
    while shard._shm_used:
        assert time.monotonic() < deadline, "the closed connection kept its shared-memory budget"
        threading.Event().wait(0.02)


def _error_after(make_server, make_client, send) -> str:
    """A connected worker's channel sends one frame out of turn; the text of the ERROR it gets back."""
    server = make_server(torch.zeros(N), world_size=1)
    client = make_client(server, 0)
    client.connect()
    channel = client._links[0].channel
    send(channel)
    header = channel.recv_header(deadline_after(2))
    assert header.type is MsgType.ERROR
    return channel.recv_json(header, deadline_after(2))["error"]


def test_a_second_request_for_rings_is_refused(make_server, make_client) -> None:
    error = _error_after(make_server, make_client, lambda channel: channel.send_empty(
        MsgType.SHM_REQUEST, generation=1, rank=0, timeout=2))
    assert "already offered" in error


def test_a_worker_gone_after_the_offer_leaves_no_segment(make_server, make_client, monkeypatch) -> None:
    offered: list[str] = []

    def ask_then_vanish(channel, *, rank, generation, deadline) -> None:
        channel.send_empty(MsgType.SHM_REQUEST, generation=generation, rank=rank, timeout=2)
        header = channel.recv_header(deadline)
        offered.append(channel.recv_json(header, deadline)["name"])
        assert os.path.exists(os.path.join(shm.SHM_DIR, offered[0]))
        raise ConnectionResetError("the worker died before it answered")

    monkeypatch.setattr("pipeline.ps.transport.opening.request_rings", ask_then_vanish)
    server = make_server(torch.zeros(N), world_size=1)
    # The open is retried once on a reset; by then the server has marked rank 0 failed and refuses it.
    with pytest.raises(AuthenticationError, match="rank 0 already failed in generation 1"):
        make_client(server, 0, connect_timeout=1.0).connect()
    deadline = deadline_after(5)
    while os.path.exists(os.path.join(shm.SHM_DIR, offered[0])):
        assert deadline is not None and deadline > time.monotonic(), "segment left behind"
        threading.Event().wait(0.02)


def test_a_client_answering_without_an_offer_is_a_protocol_error(make_server, make_client) -> None:
    error = _error_after(make_server, make_client, lambda channel: channel.send_json(
        MsgType.SHM_ATTACHED, {"attached": True}, generation=1, rank=0, timeout=2))
    assert "without a shared-memory offer" in error


def test_a_worker_that_cannot_map_the_offer_stays_on_tcp_and_the_segment_and_budget_go_at_once(
        make_server, make_client, monkeypatch) -> None:
    def unreachable(body):
        raise OSError(f"{body['name']}: no such file (a container with its own /dev/shm)")

    monkeypatch.setattr(shm, "attach", unreachable)
    before = _segments()
    server = make_server(torch.zeros(N), world_size=1)
    client = make_client(server, 0)
    client.connect()
    shard = server._shards[0]
    assert client._links[0].channel.shm is None
    assert shard._shm_used == 0 and _segments() == before  # while the connection is still open
    version, params = client.push_pull(0, torch.ones(N))
    assert version == 1 and client._links[0].channel.shm_bytes_sent == 0
    client.finish()


def test_params_are_taken_where_they_lie_in_the_ring_and_stay_put_until_the_next_params(
        make_server, make_client) -> None:
    init = torch.randn(N, generator=torch.Generator().manual_seed(5))
    server = make_server(init.clone(), world_size=1, consistency=Consistency(mode="ssp", staleness=1))
    client = make_client(server, 0)
    client.connect()
    _, first = client.pull(0)
    ring = client._links[0].channel.shm.into
    ring_start = ring._data.data_ptr()
    assert ring_start <= first.data_ptr() < ring_start + ring.size  # no copy into the client's buffer
    assert torch.equal(first, init)
    kept = first.clone()
    _, second = client.push_pull(0, torch.ones(N))  # the reply needs room beside the held first PARAMS
    assert torch.equal(first, kept)  # the server never wrote over the PARAMS in use
    assert second.data_ptr() != first.data_ptr() and torch.equal(second, server.parameters())
    assert client._links[0].channel.shm_bytes_received == 2 * 4 * N  # both through the ring, not inline
    client.finish()


def test_a_nan_push_summed_in_place_is_refused_and_the_step_it_spoilt_never_applies(
        make_server, make_client) -> None:
    from pipeline.errors import NonFiniteError

    server = make_server(torch.zeros(N), world_size=2)
    clients = [make_client(server, rank) for rank in range(2)]
    for client in clients:
        client.connect()
        client.pull(0)
    clients[0].push(0, torch.ones(N))
    poisoned = torch.ones(N)
    poisoned[7] = float("nan")
    with pytest.raises(NonFiniteError, match="rank 1 pushed a gradient with NaN/Inf for step 0"):
        clients[1].push(0, poisoned)
    with pytest.raises(NonFiniteError, match="holds rank 1's NaN/Inf push"):
        clients[1].push(0, torch.ones(N))  # a finite retry cannot repair the sum rank 0 is in
    assert server.version == 0 and torch.equal(server.parameters(), torch.zeros(N))
    assert clients[1]._links[0].channel.shm is not None  # it was the ring path


def test_sync_params_are_the_servers_own_page_which_no_worker_can_change_for_its_peers(make_server, make_client) -> None:
    init = torch.randn(N, generator=torch.Generator().manual_seed(6))
    server = make_server(init.clone(), world_size=1)
    client = make_client(server, 0)
    client.connect()
    version, first = client.pull(0)
    page = client._links[0].channel.params_page
    assert version == 0 and first.data_ptr() == page.tensor.data_ptr() and torch.equal(first, init)
    first[: N // 2].clamp_(-0.1, 0.1)  # a model writing its own parameters in forward: its own copy only
    assert torch.equal(server.parameters(), init)
    version, second = client.push_pull(0, torch.ones(N))
    assert version == 1 and second.data_ptr() == first.data_ptr()  # the same memory, now holding version 1
    assert torch.equal(second, server.parameters()) and torch.equal(second, init - 1.0)  # sgd, lr 1
    assert page.refreshed == 1  # the written pages were dropped at the pull
    assert client._links[0].channel.shm_bytes_received == 0  # no PARAMS payload at all
    offer = server._shards[0].params_page_offer()
    fd = os.open(offer["page"], os.O_RDWR)  # the same uid may open it, but the seal refuses every write
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 4, shared_page.HEADER)
        import mmap
        with pytest.raises(PermissionError):
            mmap.mmap(fd, offer["page_bytes"])  # a writable shared mapping
    finally:
        os.close(fd)
    assert torch.equal(server.parameters(), init - 1.0)
    client.finish()


def test_several_shards_copy_their_pages_into_the_slices_of_one_buffer(make_server, make_client) -> None:
    init = torch.randn(N, generator=torch.Generator().manual_seed(7))
    server = make_server(init.clone(), world_size=1, shards=2)
    client = make_client(server, 0)
    client.connect()
    _, params = client.pull(0)
    assert all(link.channel.params_page is not None for link in client._links)
    assert torch.equal(params, init) and params.data_ptr() == client._params.data_ptr()
    _, params = client.push_pull(0, torch.full((N,), 0.5))
    assert torch.equal(params, init - 0.5) and torch.equal(params, server.parameters())
    client.finish()


def test_a_worker_that_cannot_map_the_page_gets_params_through_its_ring(make_server, make_client,
                                                                          monkeypatch) -> None:
    def unreachable(body):
        raise OSError(f"{body['page']}: no such file (another PID namespace)")

    monkeypatch.setattr(shared_page, "attach", unreachable)
    init = torch.randn(N, generator=torch.Generator().manual_seed(8))
    server = make_server(init.clone(), world_size=1)
    client = make_client(server, 0)
    client.connect()
    channel = client._links[0].channel
    assert channel.shm is not None and channel.params_page is None
    _, params = client.push_pull(0, torch.ones(N))
    assert torch.equal(params, init - 1.0) and channel.shm_bytes_received == 4 * N
    client.finish()



def test_a_gradient_computed_in_the_slot_is_pushed_without_a_copy_and_a_copy_elsewhere_still_works(
        make_server, make_client) -> None:
    init = torch.zeros(N)
    server = make_server(init.clone(), world_size=1)
    client = make_client(server, 0)
    client.connect()
    client.pull(0)
    slot = client.grad_slot()
    channel = client._links[0].channel
    assert slot is not None and slot.numel() == N and channel.shm.slot_out.data.data_ptr() == slot.data_ptr()
    slot.fill_(0.25)  # what autograd accumulating into the slot's views leaves there
    ring_before = channel.shm.out._written
    _, params = client.push_pull(0, slot)
    assert torch.equal(params, torch.full((N,), -0.25))  # sgd, lr 1
    assert channel.shm.out._written == ring_before  # the out ring never took it: the slot was the push
    assert channel.shm_bytes_sent == 4 * N
    slot.fill_(0.5)  # the next step's gradient, in the same slot (the server has let go of the last)
    _, params = client.push_pull(1, slot)
    assert torch.equal(params, torch.full((N,), -0.75))
    _, params = client.push_pull(2, torch.ones(N))  # a gradient anywhere else goes through the ring
    assert torch.equal(params, torch.full((N,), -1.75)) and channel.shm.out._written > ring_before
    client.finish()


def test_compressed_and_average_pushes_get_no_slot(make_server, make_client) -> None:
    for options in ({"compression": "fp16"}, {"consistency": Consistency(mode="average", sync_every=1)}):
        server = make_server(torch.zeros(N), world_size=1, **options)
        client = make_client(server, 0)
        client.connect()
        assert client._links[0].channel.shm is not None and client._links[0].channel.shm.slot_out is None
        assert client.grad_slot() is None
        client.finish()
