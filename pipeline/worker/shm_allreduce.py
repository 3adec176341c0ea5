"""DDP's gradient buckets averaged through shared memory when every rank of a CPU group runs on one host
(``train.allreduce_shared_memory``): a DDP communication hook in place of gloo's allreduce.

Why: gloo moves a bucket over TCP loopback, so the kernel copies every byte between socket buffers, and on
a box whose cores the ranks already fill those copies are the allreduce's cost (issue 17: the allreduce
loop at 0.67-0.78 of the machine's limit). Here each rank copies its bucket into its slot of a segment in
``/dev/shm``, sums its 1/N of every slot into a result area, and copies the whole result back: two
passes over the bucket per rank and no syscall. NCCL's and oneCCL's intra-node paths do the same; gloo
has none. Ranks on different hosts (or with different ``/dev/shm``) keep gloo: every rank makes the
same choice from what all of them published in the group's authenticated store.

One round per piece of at most ``PIECE_BYTES`` of a bucket:

1. copy the piece into my slot; ``arrived[me] = seq``; wait until every rank arrived;
2. sum my chunk of all slots into ``result[seq % 2]``, divide by N; ``reduced[me] = seq``; wait for all;
3. copy ``result[seq % 2]`` into the piece.

My slot is written again only after every rank reduced (so read) it; a result area is written again two
rounds later, after every rank arrived at that round (so copied the old result out). Counters are
stored after the data they cover and loaded before it is read: x86-64's store order makes that enough
(``pipeline.wire.shm.supported``). A wait spins briefly, then sleeps in short naps; it checks that the
other ranks' processes are alive and fails after the step deadline (``timeouts.step_s``) naming the
ranks it waited for.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Optional

from pipeline.wire import shm
from pipeline.wire.deadline import Timeout

log = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # each rank's slot: a bucket larger than this goes in several rounds
_LINE = 8  # int64 words per counter: one cache line each, no false sharing between ranks
_HEAD = 64  # the token's line
_SPIN = 200  # polls before the first nap
_NAP_S = 50e-6
_ALIVE_EVERY_S = 0.2


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{os.stat(shm.SHM_DIR).st_ino if os.path.isdir(shm.SHM_DIR) else 0}"


def _layout(world: int) -> tuple[int, int, int, int]:
    """(counters offset, slots offset, results offset, total) of a segment for ``world`` ranks."""
    counters = _HEAD
    slots = counters + 3 * world * _LINE * 8  # arrived, reduced, pid
    results = slots + world * PIECE_BYTES
    return counters, slots, results, results + 2 * PIECE_BYTES


class ShmAllreduce:
    """One rank's view of the segment; called as a DDP comm hook (``register_comm_hook(None, hook)``)."""

    def __init__(self, segment: Any, rank: int, world: int, timeout: Timeout) -> None:
        import torch

        self.rank, self.world, self.timeout = rank, world, timeout
        counters, slots, results, _ = _layout(world)
        words = torch.frombuffer(segment, dtype=torch.int64, count=3 * world * _LINE, offset=counters)
        self._arrived = words[0:world * _LINE:_LINE]
        self._reduced = words[world * _LINE:2 * world * _LINE:_LINE]
        self._pids = words[2 * world * _LINE::_LINE]
        self._slots = [torch.frombuffer(segment, dtype=torch.uint8, count=PIECE_BYTES, offset=slots + r * PIECE_BYTES)
                       for r in range(world)]
        self._results = [torch.frombuffer(segment, dtype=torch.uint8, count=PIECE_BYTES,
                                          offset=results + i * PIECE_BYTES) for i in range(2)]
        self._segment = segment
        self._seq = 0
        self._pids[rank] = os.getpid()

    def comm_hook(self):
        """The function ``DistributedDataParallel.register_comm_hook`` takes (it wants a named function
        whose annotations, if any, are its own types)."""
        def shm_allreduce_hook(state, bucket):
            return self(bucket)

        return shm_allreduce_hook

    def __call__(self, bucket: Any) -> Any:
        import torch

        flat = bucket.buffer()
        self.allreduce_(flat)
        future: Any = torch.futures.Future()
        future.set_result(flat)
        return future

    def allreduce_(self, flat: Any) -> None:
        """Average the 1-D CPU tensor ``flat`` over the ranks, in place."""
        per_piece = PIECE_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per_piece):
            self._round(flat[start:start + per_piece])

    def _round(self, piece: Any) -> None:
        self._seq += 1
        seq, n, dtype = self._seq, piece.numel(), piece.dtype
        size = piece.element_size()
        self._slots[self.rank][:n * size].view(dtype).copy_(piece)
        self._arrived[self.rank] = seq
        self._wait(self._arrived, seq, "its gradient bucket")
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        out = self._results[seq % 2][:n * size].view(dtype)[lo:hi]
        if hi > lo:
            torch_sum(out, [slot[:n * size].view(dtype)[lo:hi] for slot in self._slots])
            out.div_(self.world)
        self._reduced[self.rank] = seq
        self._wait(self._reduced, seq, "its share of the sum")
        piece.copy_(self._results[seq % 2][:n * size].view(dtype))

    def _wait(self, counters: Any, seq: int, what: str) -> None:
        if bool((counters >= seq).all()):
            return
        started = checked = time.monotonic()
        polls = 0
        while not bool((counters >= seq).all()):
            polls += 1
            if polls > _SPIN:
                time.sleep(_NAP_S)
            now = time.monotonic()
            if now - checked >= _ALIVE_EVERY_S:
                checked = now
                self._check_peers(counters, seq, what, now - started)

    def _check_peers(self, counters: Any, seq: int, what: str, waited: float) -> None:
        missing = [r for r in range(self.world) if int(counters[r]) < seq]
        for r in missing:
            pid = int(self._pids[r])
            if not _alive(pid):
                raise RuntimeError(f"rank {r} (pid {pid}) died during the shared-memory allreduce (round "
                                   f"{seq}); rank {self.rank} was waiting for {what}")
        if waited > self.timeout.seconds:
            raise TimeoutError(f"rank {self.rank} waited {waited:.0f}s for {what} from rank(s) {missing} in the "
                               f"shared-memory allreduce (round {seq}); {self.timeout.hint}")

    def close(self) -> None:
        self._arrived = self._reduced = self._pids = None
        self._slots, self._results = [], []
        try:
            self._segment.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: an exited process not yet reaped by its parent (a zombie, as a
    dead Spark Python worker is until its daemon waits for it) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def torch_sum(out: Any, parts: list) -> None:
    """``out = sum(parts)`` without a temporary (the first part copied, the others added in place)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)


def join(rank: int, world: int, timeout: Timeout) -> Optional[ShmAllreduce]:
    """Collective over the default process group's store: every rank gets a hook, or every rank None
    (another host among them, no /dev/shm room, an unsupported platform). Rank 0 makes the segment and
    unlinks it once every rank said whether it mapped it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    prefix = "shardline/shm_allreduce"
    store.set(f"{prefix}/host/{rank}", _host_identity() if shm.supported() else f"unsupported|{rank}")
    hosts = {store.get(f"{prefix}/host/{r}").decode() for r in range(world)}
    if len(hosts) != 1 or not shm.supported():
        return None
    _, _, _, total = _layout(world)
    segment, name, reason = None, "", ""
    if rank == 0:
        try:
            segment, name, token = shm.create_segment(total)
            offer = {"name": name, "token": token.hex()}
        except OSError as exc:
            offer = {"declined": f"/dev/shm could not hold {total >> 20} MB: {exc}"}
        store.set(f"{prefix}/offer", json.dumps(offer))
    else:
        offer = json.loads(store.get(f"{prefix}/offer").decode())
        if "declined" not in offer:
            try:
                segment = shm.open_segment(offer["name"], total, offer["token"])
            except (OSError, ValueError) as exc:
                reason = str(exc)
    store.set(f"{prefix}/ok/{rank}", "1" if segment is not None else "0")
    ok = all(store.get(f"{prefix}/ok/{r}") == b"1" for r in range(world))
    if rank == 0 and name:
        shm.remove_segment(name)
    if not ok:
        log.info("rank %d: the shared-memory allreduce is not used (%s); gloo it is", rank,
                 offer.get("declined") or reason or "another rank could not map the segment")
        if segment is not None:
            segment.close()
        return None
    hook = ShmAllreduce(segment, rank, world, timeout)
    dist.barrier()  # every rank's pid is in the segment before anyone waits on it
    return hook
