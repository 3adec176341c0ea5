"""What the request handlers ask of a shard (``dispatch.RequestContext``), as a part of ``shard.ShardServer``.

Kept apart from the shard's lifecycle, views and failure bookkeeping because it is the one surface the
per-message handlers see: the consistency policy, the step deadline, the push dtypes, buffers and sparse
tables, the shared-memory budget, counting requests in flight, and the metrics and FINISH hooks. It works
on the shard's own state (``_cond`` guards all of it), which ``ShardServer.__init__`` sets up.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from pipeline.ps.state.buffers import BufferStore
from pipeline.ps.transport.connection import RankConnection
from pipeline.ps.modes.policies import ConsistencyPolicy
from pipeline.ps.transport.protocol import DType
from pipeline.wire.deadline import Timeout

logger = logging.getLogger("pipeline.ps.server.shard")  # the shard's own lines, as before this part moved here


class ShardRequests:
    @property
    def policy(self) -> ConsistencyPolicy:
        return self._policy

    @property
    def step_timeout(self) -> Timeout:
        return self._settings.step_timeout

    @property
    def push_dtypes(self) -> frozenset[DType]:
        return self._push_dtypes

    @property
    def buffers(self) -> BufferStore | None:
        return self._buffers

    @property
    def sparse(self) -> Any:
        return self._sparse

    @property
    def shared_memory_bytes(self) -> int:
        return self._shm_cap

    def params_page_offer(self) -> dict[str, Any] | None:
        return None if self._core.page is None else self._core.page.offer()

    def reserve_shared_memory(self, nbytes: int) -> bool:
        """Take ``nbytes`` of this shard's ps.shared_memory_mb budget for one connection's rings."""
        with self._cond:
            if self._shm_used + nbytes > self._shm_cap:
                return False
            self._shm_used += nbytes
            return True

    def release_shared_memory(self, nbytes: int) -> None:
        with self._cond:
            self._shm_used -= nbytes

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts a step request so close() can let it deliver its ERROR before sockets close."""
        with self._cond:
            self._replying += 1
        try:
            yield
        finally:
            with self._cond:
                self._replying -= 1
                self._cond.notify_all()

    def count_push_payload(self, nbytes: int) -> None:
        with self._cond:
            self._stats.push_payload_bytes += nbytes

    def count_protocol_error(self) -> None:
        with self._cond:
            self._stats.protocol_errors += 1

    def report_metrics(self, rank: int, metrics: dict[str, Any]) -> None:
        if self._on_metrics is None:
            return
        try:
            self._on_metrics(rank, metrics)
        except Exception:  # a tracking hiccup must never break training
            logger.exception("on_metrics callback failed for rank %s", rank)

    def finish(self, conn: RankConnection) -> None:
        with self._cond:
            self._roster.finish_locked(conn)
            self._cond.notify_all()
        logger.info("rank %s finished at version %s", conn.rank, self.version)

    def send_params(self, conn: RankConnection, version: int) -> None:
        self._core.send_params(conn, version)
