"""The worker's side of the sparse frames, over the authenticated shard connections of a ``PSClient``.

A table's rows live on shard 0, or (``ps.placement: hosts``) are hashed over the first ``sparse_shards``
shards the WELCOME announces (``table.owner_of``): each request is split by owner and each part goes to its
shard. Every request of a step goes out back to back, shard by shard, and the replies are read in the same
order (one round trip per step for every table and shard at once), through the client's own reply reading
(``_gather``), so an ERROR from the server, a deadline or a broken stream is handled exactly as for the
dense frames.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.transport.protocol import DType, Header, MsgType
from pipeline.ps.sparse.frames import PREFIX
from pipeline.ps.sparse.table import owner_of
from pipeline.wire.deadline import deadline_after

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": (DType.FLOAT32, torch.float32), "fp16": (DType.FLOAT16, torch.float16)}


class SparseLink:
    """Sparse pulls and pushes of one rank. ``wire_dtype``: ``ps.sparse.wire_dtype`` (fp32 or fp16)."""

    def __init__(self, client: Any, wire_dtype: str = "fp32") -> None:
        if wire_dtype not in _DTYPES:
            raise PSError(f"ps.sparse.wire_dtype must be fp32 or fp16, got {wire_dtype!r}")
        self.client = client
        self.dtype, self.torch_dtype = _DTYPES[wire_dtype]
        self.bytes_sent = 0
        self.bytes_received = 0

    def _split(self, requests: Sequence[tuple[int, int, np.ndarray, Any]]) -> list[tuple[Any, list]]:
        """Per shard holding rows, its link and its parts: (request number, table, dim, ids, positions in the
        request's ids, gradient rows or None). One shard: every request whole, empty ones included."""
        links = self.client._require()
        parts = self.client._info.sparse_shards if self.client._info is not None else 1
        if parts > len(links):
            raise ProtocolError(f"the server spreads sparse rows over {parts} shards but announced {len(links)}")
        if parts == 1:
            return [(links[0], [(n, i, d, ids, None, g) for n, (i, d, ids, g) in enumerate(requests)])]
        out: list[tuple[Any, list]] = [(link, []) for link in links[:parts]]
        for n, (index, dim, ids, grad) in enumerate(requests):
            owners = owner_of(ids, parts)
            for p in range(parts):
                pos = np.flatnonzero(owners == p)
                if len(pos):  # ids stay sorted: a subsequence of sorted ids
                    rows = None if grad is None else grad[torch.from_numpy(pos)]
                    out[p][1].append((n, index, dim, ids[pos], pos, rows))
        return [(link, items) for link, items in out if items]

    def _send(self, link: Any, msg_type: MsgType, step: int, index: int, dim: int, ids: np.ndarray,
              grad: torch.Tensor | None = None) -> None:
        ids = np.ascontiguousarray(ids, dtype="<i8")
        parts = [PREFIX.pack(index, dim), ids.tobytes()]
        if grad is not None:
            parts.append(grad.detach().to("cpu", self.torch_dtype).contiguous().numpy().tobytes())
        payload = b"".join(parts)
        link.channel.send(Header(msg_type, self.client.generation, self.client.rank, step, self.dtype, len(ids),
                                 len(payload)), payload, timeout=self.client.timeout_s)
        self.bytes_sent += len(payload)

    def _exchange(self, msg_type: MsgType, step: int, split: list[tuple[Any, list]], what: str,
                  reply: MsgType, receive: Any) -> None:
        client = self.client
        by_link = {id(link): items for link, items in split}
        client._send_all([link for link, _ in split],
                         lambda link: [self._send(link, msg_type, step, i, d, ids, g)
                                       for _, i, d, ids, _, g in by_link[id(link)]], what)
        order = [(link, item) for link, items in split for item in items]
        pending = iter(order)
        client._gather([link for link, _ in order], reply, what, client._reply_wait,
                       lambda link, header: receive(link, header, next(pending)[1]))

    def pull(self, step: int, requests: Sequence[tuple[int, int, np.ndarray]]) -> list[torch.Tensor]:
        """Rows (fp32 [n, dim]) of each (table index, dim, distinct sorted ids), one round trip for all."""
        client = self.client
        out = [torch.empty(len(ids), dim) for _, dim, ids in requests]

        def receive(link: Any, header: Header, item: tuple) -> int:
            n, _, dim, ids, pos, _ = item
            itemsize = 4 if header.dtype is DType.FLOAT32 else 2
            if header.count != len(ids) or header.length != len(ids) * dim * itemsize or header.dtype is not self.dtype:
                raise ProtocolError(f"SPARSE_ROWS of {header.count} rows / {header.length} bytes, expected "
                                    f"{len(ids)} rows of {dim} {self.dtype.name}")
            body = bytearray(header.length)
            link.channel.recv_exact(memoryview(body), deadline_after(client._reply_wait))
            self.bytes_received += header.length
            rows = torch.frombuffer(body, dtype=self.torch_dtype) if header.length else \
                torch.empty(0, dtype=self.torch_dtype)
            rows = rows.reshape(len(ids), dim).to(torch.float32)
            if pos is None:
                out[n] = rows
            else:
                out[n][torch.from_numpy(pos)] = rows
            return header.step

        split = self._split([(i, d, ids, None) for i, d, ids in requests])
        self._exchange(MsgType.SPARSE_PULL, step, split, f"sparse rows for step {step}", MsgType.SPARSE_ROWS, receive)
        return out

    def push(self, step: int, pushes: Sequence[tuple[int, np.ndarray, torch.Tensor]]) -> None:
        """Each (table index, distinct sorted ids, summed row gradients [n, dim]) for ``step``; waits
        for every ACK (sync: the rows are held until the step's dense update, which a rank pushes after)."""
        split = self._split([(i, g.shape[1], ids, g) for i, ids, g in pushes])
        self._exchange(MsgType.SPARSE_PUSH, step, split, f"the ACK of the sparse rows for step {step}", MsgType.ACK,
                       lambda link, header, item: header.step)
