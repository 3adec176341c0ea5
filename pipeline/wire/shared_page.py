"""The parameter server's parameters in one sealed memory page that local workers map copy-on-write
(``ps.shared_memory_mb``; sync mode, ``pipeline.ps.transport.shm_offer``).

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
- A worker's view is a private (copy-on-write) mapping: a model that writes its own parameters in place
  in forward (a user factory's clamp, ``nn.Embedding`` with ``max_norm``) changes only its own copy of
  the pages it wrote, never the server's or a peer's. ``PageView.refresh``, at every PARAMS_SHARED,
  finds such pages in ``/proc/self/pagemap`` (present and no longer the file's) and drops them with
  ``MADV_DONTNEED``, so they read the server's version again: exactly what a PARAMS copy over private
  memory does to a worker's own writes. A worker that cannot read its pagemap, or whose pagemap does not
  tell a written page apart (checked once at attach), declines the page.
  ``pipeline.worker.exchange`` still copies for ``nn.Embedding(max_norm)``, which would write pages
  every step.
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
# /proc/<pid>/pagemap, one 64-bit entry per page (Documentation/admin-guide/mm/pagemap.rst): present,
# swapped, and "file page or shared anonymous". A page of the private view that this process wrote is
# an anonymous copy: present (or swapped) without the file bit. The flags are readable unprivileged.
_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61


def supported() -> bool:
    return shm.supported() and hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


class SharedPage:
    """The server's side: ``count`` fp32 values in a sealed memfd, writable by this process only.

    Raises OSError when the host cannot make one (no memfd, an old kernel without the seal, no memory);
    the caller keeps its parameters in private memory then."""

    def __init__(self, count: int) -> None:
        import torch

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


class PageView:
    """The worker's side: the server's page mapped private, its fp32 values as ``tensor``.

    ``refresh`` (at every PARAMS_SHARED) drops the pages this process wrote since the last one, so the
    tensor holds the server's version again (module docstring)."""

    def __init__(self, mapping: mmap.mmap, count: int) -> None:
        import torch

        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)  # first: may fail
        self._map = mapping
        self.tensor = torch.frombuffer(mapping, dtype=torch.float32, count=count, offset=HEADER)
        start = self.tensor.data_ptr() - HEADER  # the mapping's start: page-aligned
        self._first, self._pages = start // mmap.PAGESIZE, -(-len(mapping) // mmap.PAGESIZE)
        self.refreshed = 0  # PARAMS_SHARED at which the model had written some of its parameters
        self._check_pagemap()

    def _check_pagemap(self) -> None:
        # A kernel that hid the pagemap flags would make every write look unwritten: the worker would then
        # keep its own copy of such a page and never see the server's updates to it. Prove the flags once
        # on the token's page (rewriting a byte with itself copies the page) and decline the page if not.
        self._map[0] = self._map[0]
        problem = None if self.written_pages() == (0, 1) else \
            "/proc/self/pagemap does not tell this process's written pages apart"
        self._map.madvise(mmap.MADV_DONTNEED, 0, mmap.PAGESIZE)
        if problem is None and self.written_pages() is not None:
            problem = "MADV_DONTNEED did not drop this process's copy of the shared parameter page"
        if problem is not None:
            del self.tensor  # its export of the mapping, so that attach can close it
            self.close()
            raise OSError(problem)

    def written_pages(self) -> tuple[int, int] | None:
        """(first, end) page index within the mapping of what this process wrote, or None."""
        import numpy as np

        raw = os.pread(self._pagemap, 8 * self._pages, 8 * self._first)
        entries = np.frombuffer(raw, dtype=np.uint64)
        written = np.flatnonzero(((entries & np.uint64(_PRESENT | _SWAPPED)) != 0)
                                 & ((entries & np.uint64(_FILE_PAGE)) == 0))
        return None if not len(written) else (int(written[0]), int(written[-1]) + 1)

    def refresh(self) -> None:
        """Drop this process's own writes: the written pages read the server's page again."""
        written = self.written_pages()
        if written is None:
            return
        first, end = written
        self._map.madvise(mmap.MADV_DONTNEED, first * mmap.PAGESIZE,
                          min(end * mmap.PAGESIZE, len(self._map)) - first * mmap.PAGESIZE)
        if not self.refreshed:
            logger.info("the model wrote its parameters in place in forward; those writes stay in this "
                        "worker and are replaced by the server's version at every pull, as over TCP")
        self.refreshed += 1

    def close(self) -> None:
        """Close the pagemap; the mapping goes with the last tensor that views it."""
        if self._pagemap >= 0:
            os.close(self._pagemap)
            self._pagemap = -1


def attach(offer: dict[str, Any]) -> PageView:
    """The worker's side: the offered page mapped private (copy-on-write) as a ``PageView`` (its size is
    checked against the shard's slice where PARAMS_SHARED is read). Raises OSError or ValueError
    (another host's or another container's process, a malformed offer, another size or token) for the
    caller to decline."""
    path, size, token = offer.get("page"), offer.get("page_bytes"), offer.get("page_token")
    if not isinstance(path, str) or not _PATH.fullmatch(path) or not isinstance(token, str) \
            or len(token) != 2 * _TOKEN or not isinstance(size, int) or isinstance(size, bool) \
            or size <= HEADER or (size - HEADER) % 4:
        raise ValueError("malformed shared parameter page offer")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError("the shared parameter page has another size than offered")
        # Private: the seal refuses a writable shared mapping, and this process's writes stay its own.
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if mapping[:_TOKEN] != bytes.fromhex(token):
        mapping.close()
        raise ValueError("the shared parameter page holds another token (not the same memory)")
    try:
        return PageView(mapping, (size - HEADER) // 4)
    except BaseException:
        mapping.close()
        raise
