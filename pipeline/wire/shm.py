"""Shared-memory payload rings for a connection whose two ends share a host (``ps.shared_memory_mb``).

Why: over TCP loopback every large payload is copied twice by the kernel (sender into the socket buffer,
socket buffer into the receiver), in socket-buffer-sized pieces with a syscall each. The parameter server
moves every worker's gradient in and the parameters out, so on one host those copies were most of its CPU
per step (``bench/ps_bench.py``'s server CPU table). With a ring in ``/dev/shm`` that both ends map, a
large payload costs one ``memcpy`` by the sender, and the receiver either copies it out or uses it where
it lies (``Channel.recv_in_place``, held from the writer meanwhile); a gradient computed in the
connection's slot (``ShmLink.slot_out``) is not even copied by the sender. Nobody holds the GIL while
copying. The TCP connection still carries every header, followed by an 8-byte descriptor instead of the
payload, so ordering, deadlines, peer-death detection and authentication stay exactly the socket's.
NCCL's and oneCCL's intra-node transports take the same route.

How it is kept safe:

- The server creates the segment (``O_EXCL``, mode 0600, a random 128-bit name) and reserves its pages
  with ``posix_fallocate``, so a full ``/dev/shm`` is refused at creation instead of a SIGBUS mid-copy.
  The name travels in the WELCOME, after the mutual handshake; the client proves it mapped the same memory
  by reading back the random token written at its start, and the server unlinks the file as soon as the
  client answered: nothing is left behind when either process dies.
- The writer never waits: a payload that does not fit the free part of its ring goes inline on the socket
  as before. The reader checks every descriptor (inside the ring, after the previous one) before it copies.
- Ordering: the writer copies, then sends the header (a syscall); the reader receives it, then copies out,
  then stores the ring's ``consumed`` counter, which the writer loads before reusing that space. On x86-64
  (total store order) plain aligned 8-byte loads and stores give exactly that; other architectures would
  need fences Python cannot issue, so there it is off (``supported()``).

Why not ``multiprocessing.shared_memory``: before Python 3.13, attaching registers the segment with the
resource tracker, which unlinks it when the attaching process exits (bpo-39959), and it cannot reserve
pages up front.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.errors import ProtocolError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# Smaller payloads go inline: one small send costs less than the ring's bookkeeping.
MIN_BYTES = 64 * 1024
# Header byte 6 (the first pad byte of every 48-byte header layout) marks "payload in the ring" (1) or
# "in the gradient slot" (2, ``ShmLink.slot_into``); the 8-byte descriptor that follows the header is that
# ring's position just past the payload.
FLAG_OFFSET = 6
IN_RING, IN_SLOT = 1, 2
DESCRIPTOR = struct.Struct("<Q")
_TOKEN = 16
_ALIGN = 64
# Every payload starts at a multiple of this offset (``Ring.put``): a reader may view it as fp32 in place.
PAYLOAD_ALIGN = _ALIGN
_CTRL = 64  # each ring's control block: the reader's consumed position, alone on its cache line
_PREFIX = "shardline-"


def supported() -> bool:
    """Whether this host can run the rings (Linux /dev/shm, x86-64's store order)."""
    return platform.machine().lower() in {"x86_64", "amd64"} and os.path.isdir(SHM_DIR)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Ring:
    """One direction of a segment: ``size`` data bytes and the reader's consumed position.

    Positions grow without bound (u64); ``position % size`` is the offset in the data. A payload is
    always contiguous: one that would cross the end starts again at offset 0 and the tail is skipped."""

    def __init__(self, segment: Any, ctrl: int, size: int) -> None:
        import torch  # the peers of a ring are PS processes, which have torch loaded already

        self.size = size
        self._consumed = torch.frombuffer(segment, dtype=torch.int64, count=1, offset=ctrl)
        self._data = torch.frombuffer(segment, dtype=torch.uint8, count=size, offset=ctrl + _CTRL)
        self._written = 0  # writer: the position after the last payload put
        self._read_start = self._read_end = 0  # reader: the last payload taken, its start and end positions
        self._read_at = 0  # reader: the data offset of the next byte of the payload being read
        self._held: Optional[int] = None  # reader: the start of a payload still in use (``hold``)
        self._reading = False  # reader: between ``begin`` and ``release``

    def put(self, payload: Any, *, in_place_only: bool = False) -> Optional[int]:
        """Copy ``payload`` (a buffer) into the ring; its end position, or None if it does not fit now
        (``in_place_only``: or if it is not already where it would go)."""
        import torch

        source = memoryview(payload).cast("B")
        n = source.nbytes
        if n > self.size:
            return None
        start = _round_up(self._written)  # PAYLOAD_ALIGN
        offset = start % self.size
        if offset + n > self.size:
            start += self.size - offset
            offset = 0
        end = start + n
        if end - int(self._consumed[0]) > self.size:
            return None  # the reader still holds that space: inline instead of waiting
        if in_place_only:  # already where it goes, written there in place (a gradient slot), or nothing
            if not n or not self.holds_at(source, offset):
                return None
        elif not n:
            pass
        elif source.readonly:
            self._data[offset:offset + n].copy_(torch.frombuffer(bytearray(source), dtype=torch.uint8))
        else:  # torch.frombuffer wants a writable buffer; large payloads are (tensor views)
            self._data[offset:offset + n].copy_(torch.frombuffer(source, dtype=torch.uint8))
        self._written = end
        return end

    @property
    def data(self) -> Any:
        """The ring's data bytes (a uint8 tensor over the segment)."""
        return self._data

    def holds_at(self, source: memoryview, offset: int) -> bool:
        """Whether ``source`` is this ring's own memory at data ``offset``."""
        import torch

        return not source.readonly and \
            torch.frombuffer(source, dtype=torch.uint8).data_ptr() == self._data.data_ptr() + offset

    def begin(self, end: int, length: int) -> None:
        """Start reading the payload of ``length`` bytes that ends at ``end``; its bounds checked."""
        start = end - length
        offset = start % self.size if self.size else 0
        if length > self.size or start < self._read_end or start - self._read_end >= self.size \
                or offset + length > self.size:
            raise ProtocolError(f"shared-memory descriptor out of bounds (end {end}, {length} bytes, ring of "
                                f"{self.size} bytes, previous end {self._read_end})")
        self._read_at = offset
        self._read_start, self._read_end = start, end
        self._reading = True

    def take(self, view: memoryview) -> None:
        """Copy the next ``len(view)`` bytes of the current payload into ``view``."""
        import torch

        n = view.nbytes
        if n:
            torch.frombuffer(view, dtype=torch.uint8).copy_(self._data[self._read_at:self._read_at + n])
        self._read_at += n

    @property
    def read_offset(self) -> int:
        """The data offset of the next byte of the current payload."""
        return self._read_at

    def view(self, n: int) -> Any:
        """The next ``n`` bytes of the current payload in place (a uint8 tensor over the ring), no copy:
        valid while the payload's space is not released (``hold``)."""
        out = self._data[self._read_at:self._read_at + n]
        self._read_at += n
        return out

    def hold(self) -> None:
        """Keep the current payload's space from the writer after ``release`` (until the next ``hold``
        or ``unhold``): its bytes are in use in place. Replaces an earlier hold, whose space comes free."""
        self._held = self._read_start

    def unhold(self) -> None:
        """No payload in use in place any more: what was read may be written again (all of it, or up to
        the payload being read now)."""
        if self._held is not None:
            self._held = None
            self._consumed[0] = self._read_start if self._reading else self._read_end

    def release(self) -> None:
        """The current payload is read: its space may be written again (a held payload's excepted, and
        so everything after it, as ``consumed`` is one position)."""
        self._consumed[0] = self._read_end if self._held is None else self._held
        self._reading = False

    def drop(self) -> None:
        self._consumed = self._data = None  # type: ignore[assignment]


@dataclass
class ShmLink:
    """Both rings of one connection as one end sees them: ``out`` it writes, ``into`` it reads."""

    out: Ring
    into: Ring
    _map: mmap.mmap
    path: str = ""
    # client -> server, when offered: a ring of exactly one gradient that the client's autograd writes
    # into in place, so its PUSH is only the descriptor. One end has it as ``slot_out`` (the client,
    # which writes it), the other as ``slot_into`` (the server, which reads it).
    slot_out: Optional[Ring] = None
    slot_into: Optional[Ring] = None

    def close(self) -> None:
        for ring in (self.out, self.into, self.slot_out, self.slot_into):
            if ring is not None:
                ring.drop()
        try:
            self._map.close()
        except BufferError:  # a tensor view still alive somewhere: the mapping goes with it
            pass


def _layout(ring_bytes: int, reply_bytes: int, slot_bytes: int = 0) -> tuple[int, int, int, int]:
    """(client->server ring control offset, server->client ring control offset, gradient slot control
    offset, total size)."""
    first = _ALIGN
    second = first + _CTRL + _round_up(ring_bytes)
    third = second + _CTRL + _round_up(reply_bytes)
    return first, second, third, third + (_CTRL + _round_up(slot_bytes) if slot_bytes else 0)


def create_segment(total: int) -> tuple[mmap.mmap, str, bytes]:
    """A new private segment of ``total`` bytes, its pages reserved, a random token at its start:
    (mapping, name, token). Raises OSError when /dev/shm cannot hold it. The caller unlinks it."""
    name = _PREFIX + secrets.token_hex(16)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, total)  # a full tmpfs says ENOSPC here, not SIGBUS on a copy
            segment = mmap.mmap(fd, total)
        except BaseException:
            os.unlink(path)
            raise
    finally:
        os.close(fd)
    token = secrets.token_bytes(_TOKEN)
    segment[:_TOKEN] = token
    return segment, name, token


def open_segment(name: Any, total: int, token: Any) -> mmap.mmap:
    """Map the segment ``name`` made by ``create_segment`` and check its size and token. Raises OSError or
    ValueError (another host's segment, or a /dev/shm this process does not share)."""
    name, token = str(name), str(token)
    if not name.startswith(_PREFIX) or "/" in name or len(token) != 2 * _TOKEN:
        raise ValueError("malformed shared-memory segment name or token")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size != total:
            raise ValueError("the shared-memory segment has another size than offered")
        segment = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    if segment[:_TOKEN] != bytes.fromhex(token):
        segment.close()
        raise ValueError("the shared-memory segment holds another token (not the same memory)")
    return segment


def remove_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def create(ring_bytes: int, slot_bytes: int = 0, reply_bytes: Optional[int] = None) -> tuple[ShmLink, dict[str, Any]]:
    """The server's side: a new segment with a client->server ring of ``ring_bytes``, a server->client
    ring of ``reply_bytes`` (``ring_bytes`` if None) and a gradient slot of ``slot_bytes`` (none if 0),
    and the offer for the WELCOME. Raises OSError when /dev/shm cannot hold it."""
    reply_bytes = ring_bytes if reply_bytes is None else reply_bytes
    first, second, third, total = _layout(ring_bytes, reply_bytes, slot_bytes)
    segment, name, token = create_segment(total)
    size, reply, slot = _round_up(ring_bytes), _round_up(reply_bytes), _round_up(slot_bytes)
    link = ShmLink(out=Ring(segment, second, reply), into=Ring(segment, first, size), _map=segment,
                   path=os.path.join(SHM_DIR, name), slot_into=Ring(segment, third, slot) if slot else None)
    return link, {"name": name, "ring_bytes": size, "reply_ring_bytes": reply, "slot_bytes": slot,
                  "token": token.hex()}


def attach(offer: Any) -> ShmLink:
    """The client's side: map the offered segment and check its token. Raises OSError or ValueError
    (another host's segment, or a /dev/shm this process does not share) for the caller to decline."""
    if not isinstance(offer, dict):
        raise ValueError("malformed shared-memory offer")
    size = offer.get("ring_bytes")
    reply, slot = offer.get("reply_ring_bytes", size), offer.get("slot_bytes", 0)
    for value in (size, reply, slot):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % _ALIGN:
            raise ValueError("malformed shared-memory offer")
    if not size or not reply:
        raise ValueError("malformed shared-memory offer")
    first, second, third, total = _layout(size, reply, slot)
    segment = open_segment(offer.get("name", ""), total, offer.get("token", ""))
    return ShmLink(out=Ring(segment, first, size), into=Ring(segment, second, reply), _map=segment,
                   slot_out=Ring(segment, third, slot) if slot else None)


def unlink(link: ShmLink) -> None:
    """Remove the server's segment file (both mappings stay valid); idempotent."""
    if link.path:
        try:
            os.unlink(link.path)
        except FileNotFoundError:
            pass
        link.path = ""
