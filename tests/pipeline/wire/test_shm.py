"""Shared-memory payload rings (pipeline.wire.shm) and the Channel that sends large payloads through them:
exact bytes through wrap-around, never a wait when full (the caller goes inline), hostile descriptors
refused before a byte is copied, segments private to the user and checked by their token."""
from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
import torch

from pipeline.errors import ProtocolError
from pipeline.wire import shm
from pipeline.wire.deadline import deadline_after
from pipeline.wire.frames import HEADER_SIZE, Channel, Header, unpack_header

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory rings need x86-64 Linux")


@pytest.fixture
def links():
    server, offer = shm.create(256 * 1024)
    client = shm.attach(offer)
    yield server, client, offer
    shm.unlink(server)
    server.close()
    client.close()


def _bytes(n: int, seed: int) -> bytearray:
    return bytearray(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.uint8).numpy().tobytes())


def _read(ring: shm.Ring, end: int, n: int) -> bytearray:
    out = bytearray(n)
    ring.begin(end, n)
    ring.take(memoryview(out)[: n // 3])
    ring.take(memoryview(out)[n // 3:])
    ring.release()
    return out


def test_payloads_wrap_around_the_ring_byte_exact(links) -> None:
    server, client, _ = links
    size = client.out.size
    for i in range(12):  # 0.4 of the ring each: every third payload skips the tail and starts at 0
        payload = _bytes(int(0.4 * size) + i, seed=i)
        end = client.out.put(payload)
        assert end is not None
        assert _read(server.into, end, len(payload)) == payload


def test_a_full_ring_refuses_instead_of_waiting_until_the_reader_releases(links) -> None:
    server, client, _ = links
    size = client.out.size
    first = _bytes(int(0.6 * size), 1)
    end = client.out.put(first)
    assert client.out.put(_bytes(int(0.6 * size), 2)) is None  # unread: no room, the caller goes inline
    assert client.out.put(_bytes(size + 1, 3)) is None  # never fits
    assert _read(server.into, end, len(first)) == first
    assert client.out.put(_bytes(int(0.6 * size), 2)) is not None


@pytest.mark.parametrize("end, length", [
    (10 ** 9, 64),  # far past anything written: skips more than a ring
    (100, 200),  # starts before 0
    (256 * 1024 + 64, 128),  # crosses the end of the data
    (1 << 62, 1 << 40),  # longer than the ring
])
def test_out_of_bounds_descriptors_are_refused(links, end, length) -> None:
    server, _, _ = links
    with pytest.raises(ProtocolError, match="descriptor out of bounds"):
        server.into.begin(end, length)


def test_a_descriptor_overlapping_the_previous_payload_is_refused(links) -> None:
    server, client, _ = links
    end = client.out.put(_bytes(1000, 1))
    _read(server.into, end, 1000)
    with pytest.raises(ProtocolError, match="previous end"):
        server.into.begin(end + 10, 20)


def test_the_segment_is_private_and_removed_once_unlinked(links) -> None:
    server, _, offer = links
    path = os.path.join(shm.SHM_DIR, offer["name"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    shm.unlink(server)
    assert not os.path.exists(path)


@pytest.mark.parametrize("change", [
    {"token": "00" * 16}, {"name": "../etc/passwd"}, {"name": "not-ours"}, {"ring_bytes": 100},
    {"ring_bytes": "64"},
])
def test_an_offer_that_is_not_this_segment_is_declined(links, change) -> None:
    _, _, offer = links
    with pytest.raises((ValueError, OSError)):
        shm.attach(dict(offer, **change))


def test_channels_send_large_payloads_through_the_ring_and_small_ones_inline(links, monkeypatch) -> None:
    server, client, _ = links
    release = server.into.release

    def late_release() -> None:  # a reader descheduled between its last read and the release
        threading.Event().wait(0.05)
        release()

    monkeypatch.setattr(server.into, "release", late_release)
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    sender.shm, receiver.shm = client, server
    try:
        frames = [_bytes(200_000, 1), _bytes(1000, 2), _bytes(200_000, 3), _bytes(200_000, 4)]
        ring_bytes_before = []

        def send_all() -> None:
            for i, payload in enumerate(frames):
                ring_bytes_before.append(sender.shm_bytes_sent)
                if i == 3:  # the ring's space is only free again once the receiver released frame 0
                    while receiver.shm_bytes_received < 200_000:
                        threading.Event().wait(0.01)
                sender.send(Header(5, 1, 0, i, 0, 0, len(payload)), payload, timeout=5)

        thread = threading.Thread(target=send_all)
        thread.start()
        for i, payload in enumerate(frames):
            head = bytes(receiver.recv_header_bytes(deadline_after(5)))
            assert unpack_header(head)[3] == i and head[shm.FLAG_OFFSET] == 0
            out = bytearray(len(payload))
            receiver.recv_exact(memoryview(out)[:777], deadline_after(5))
            receiver.recv_exact(memoryview(out)[777:], deadline_after(5))
            assert out == payload
        thread.join(5)
        # Frame 0 in the ring, 1 inline (small), 2 inline (the ring still held frame 0), 3 in the ring.
        assert ring_bytes_before == [0, 200_000, 200_000, 200_000]
        assert sender.shm_bytes_sent == receiver.shm_bytes_received == 400_000
        # Byte counts stay logical: every header and payload, plus the descriptors of the two ring frames.
        assert receiver.bytes_received == 4 * HEADER_SIZE + 2 * shm.DESCRIPTOR.size + sum(map(len, frames))
    finally:
        sender.shm = receiver.shm = None
        sender.close()
        receiver.close()


def test_without_rings_the_flag_byte_is_padding_as_before() -> None:
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    try:
        flagged = bytearray(Header(5, 1, 0, 0, 0, 0, 10).pack())
        flagged[shm.FLAG_OFFSET] = 1
        a.sendall(bytes(flagged) + b"0123456789")
        receiver.recv_header_bytes(deadline_after(5))
        out = bytearray(10)
        receiver.recv_exact(memoryview(out), deadline_after(5))
        assert out == b"0123456789"
    finally:
        sender.close()
        receiver.close()


def test_bytes_that_are_no_frame_are_named_so_even_with_the_ring_flag_set() -> None:
    """Random bytes with byte 6 set on a channel with rings (hypothesis found the ordering on one without):
    the error is the bad magic, not the ring."""
    server, offer = shm.create(64 * 1024)
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    receiver.shm = server
    shm.unlink(server)
    try:
        junk = bytearray(HEADER_SIZE)
        junk[shm.FLAG_OFFSET] = 1
        a.sendall(bytes(junk))
        with pytest.raises(ProtocolError, match="bad magic"):
            receiver.recv_header_bytes(deadline_after(5))
    finally:
        sender.close()
        receiver.close()


def test_a_held_payload_keeps_its_space_from_the_writer_until_unheld(links) -> None:
    server, client, _ = links
    size = client.out.size
    held_bytes = _bytes(int(0.3 * size), 7)
    end = client.out.put(held_bytes)
    server.into.begin(end, len(held_bytes))
    view = server.into.view(len(held_bytes))
    assert server.into.read_offset == len(held_bytes) and view.data_ptr() % 64 == 0
    server.into.hold()
    server.into.release()
    written = 0
    for i in range(8):  # the rest of the ring fills, then the writer refuses: never over the held bytes
        payload = _bytes(int(0.3 * size), 10 + i)
        end = client.out.put(payload)
        if end is None:
            break
        written += 1
        assert _read(server.into, end, len(payload)) == payload
    assert written >= 2 and end is None
    assert bytes(view.numpy().tobytes()) == bytes(held_bytes)
    server.into.unhold()
    assert client.out.put(_bytes(int(0.3 * size), 99)) is not None  # its space came free


def test_a_slot_carries_only_payloads_written_in_it_and_a_flag_for_a_missing_slot_is_refused() -> None:
    server, offer = shm.create(256 * 1024, 128 * 1024)
    client = shm.attach(offer)
    shm.unlink(server)
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    sender.shm, receiver.shm = client, server
    try:
        in_slot = client.slot_out.data[:100_000]
        in_slot.copy_(torch.arange(100_000) % 251)
        assert client.slot_out.put(_bytes(100_000, 1), in_place_only=True) is None  # elsewhere: never copied in
        sender.send(Header(5, 1, 0, 0, 0, 0, 100_000), memoryview(in_slot.numpy()), timeout=5)
        head = bytes(receiver.recv_header_bytes(deadline_after(5)))
        assert head[shm.FLAG_OFFSET] == 0 and client.out._written == 0  # through the slot, not the ring
        view = receiver.recv_in_place(Header(5, 1, 0, 0, 0, 0, 100_000))
        assert view.data_ptr() == server.slot_into.data.data_ptr() and torch.equal(view, in_slot)
        receiver.drop_in_place()
        flagged = bytearray(Header(5, 1, 0, 0, 0, 0, 100_000).pack())
        flagged[shm.FLAG_OFFSET] = shm.IN_SLOT
        receiver.shm = shm.ShmLink(out=server.out, into=server.into, _map=server._map)  # no slot offered
        a.sendall(bytes(flagged) + shm.DESCRIPTOR.pack(100_000))
        with pytest.raises(ProtocolError, match="flag 2 names no ring"):
            receiver.recv_header_bytes(deadline_after(5))
    finally:
        sender.shm = receiver.shm = None
        sender.close()
        receiver.close()
        client.close()
        server.close()
