"""The parameter server's parameters in one sealed memory page that local workers map read-only
(``ps.shared_memory_mb``; sync mode, ``pipeline.ps.shm_offer``).

Why: with rings (``pipeline.wire.shm``) the server still copies the parameters into every local worker's
ring after each update, N copies of the whole model on the synchronous round's serial tail, where every
worker waits (issue 17: about 3.5 ms of a 4.4 MB model's ~7 ms tail on a 2-core box). In sync mode no
worker computes while an update is applied (every rank has pushed and waits for the next version), so the
workers can read the parameters where the server keeps them: the PARAMS reply is then a header that names
the version, and nothing is copied at all.

How it is kept safe:

- The page is a ``memfd`` (no file in /dev/shm, nothing left behind by a crash, not limited by a small
  /dev/shm), sealed after the server mapped it writable: ``F_SEAL_FUTURE_WRITE`` makes every later
  writable shared mapping and every ``write`` fail for every process, so a worker can read the
  parameters but never change them for its peers; size seals keep it from being shrunk under a reader
  (which would be a SIGBUS).
- The server offers ``/proc/<pid>/fd/<fd>`` only after the mutual handshake, inside the SHM_OFFER; the
  worker opens it read-only, checks its size, and proves it mapped the same memory by the random token at
  the page's start, as for the rings.
- A worker's view is mapped ``PROT_READ``: a model that wrote its own parameters in place would fault
  (``pipeline.worker.exchange`` copies instead for the one in-tree module that does: ``nn.Embedding``
  with ``max_norm``; ``ps.shared_memory_mb: 0`` turns the page off with the rings).
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
from typing import Any

from pipeline.wire import shm

logger = logging.getLogger(__name__)

_TOKEN = 16
HEADER = 64  # the token, then the fp32 data from a cache-line boundary
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux >= 5.1; Python names it from 3.13
_PATH = re.compile(r"/proc/[0-9]{1,10}/fd/[0-9]{1,10}")


def supported() -> bool:
    return shm.supported() and hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


class SharedPage:
    """The server's side: ``count`` fp32 values in a sealed memfd, writable by this process only.

    Raises OSError when the host cannot make one (no memfd, an old kernel without the seal, no memory);
    the caller keeps its parameters in private memory then."""

    def __init__(self, count: int) -> None:
        import torch

        self.count = count
        self.nbytes = HEADER + 4 * count
        fd = os.memfd_create("shardline-params", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.nbytes)
            os.posix_fallocate(fd, 0, self.nbytes)  # pages reserved now, not a SIGBUS mid-update
            self._map = mmap.mmap(fd, self.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE
                        | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.token = secrets.token_bytes(_TOKEN)
        self._map[:_TOKEN] = self.token
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32, count=count, offset=HEADER)

    def offer(self) -> dict[str, Any] | None:
        """What SHM_OFFER carries for it; None once closed."""
        if self._fd is None:
            return None
        return {"page": f"/proc/{os.getpid()}/fd/{self._fd}", "page_bytes": self.nbytes,
                "page_token": self.token.hex()}

    def close(self) -> None:
        """No more workers may map it; the memory stays while the server's tensor (and any worker's view)
        lives. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def attach(offer: dict[str, Any]) -> Any:
    """The worker's side: the offered page mapped read-only, as a read-only fp32 tensor (its size is
    checked against the shard's slice where PARAMS_SHARED is read). Raises OSError or ValueError (another host's or another container's process, a malformed
    offer, another size or token) for the caller to decline."""
    import warnings

    import torch

    path, size, token = offer.get("page"), offer.get("page_bytes"), offer.get("page_token")
    if not isinstance(path, str) or not _PATH.fullmatch(path) or not isinstance(token, str) \
            or len(token) != 2 * _TOKEN or not isinstance(size, int) or isinstance(size, bool) \
            or size <= HEADER or (size - HEADER) % 4:
        raise ValueError("malformed shared parameter page offer")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError("the shared parameter page has another size than offered")
        mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if mapping[:_TOKEN] != bytes.fromhex(token):
        mapping.close()
        raise ValueError("the shared parameter page holds another token (not the same memory)")
    with warnings.catch_warnings():  # "not writable": that is the point (see module docstring)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.float32, count=(size - HEADER) // 4, offset=HEADER)
