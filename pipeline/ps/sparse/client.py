"""The worker's side of the sparse frames, over its authenticated shard-0 connection of a ``PSClient``.

Requests of several tables go out back to back and their replies are read in the same order (one
round trip per step for every table at once), through the client's own reply reading (``_gather``), so
an ERROR from the server, a deadline or a broken stream is handled exactly as for the dense frames.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.transport.protocol import DType, Header, MsgType
from pipeline.ps.sparse.frames import PREFIX
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

    def _link(self):
        return self.client._require()[0]

    def _send(self, msg_type: MsgType, step: int, index: int, dim: int, ids: np.ndarray,
              grad: torch.Tensor | None = None) -> None:
        ids = np.ascontiguousarray(ids, dtype="<i8")
        parts = [PREFIX.pack(index, dim), ids.tobytes()]
        if grad is not None:
            parts.append(grad.detach().to("cpu", self.torch_dtype).contiguous().numpy().tobytes())
        payload = b"".join(parts)
        link = self._link()
        link.channel.send(Header(msg_type, self.client.generation, self.client.rank, step, self.dtype, len(ids),
                                 len(payload)), payload, timeout=self.client.timeout_s)
        self.bytes_sent += len(payload)

    def pull(self, step: int, requests: Sequence[tuple[int, int, np.ndarray]]) -> list[torch.Tensor]:
        """Rows (fp32 [n, dim]) of each (table index, dim, distinct sorted ids), one round trip for all."""
        client = self.client
        what = f"sparse rows for step {step}"
        links = [self._link()] * len(requests)
        client._send_all(links[:1], lambda link: [self._send(MsgType.SPARSE_PULL, step, i, d, ids)
                                                  for i, d, ids in requests], what)
        out: list[torch.Tensor] = []
        pending = iter(requests)

        def receive(link: Any, header: Header) -> int:
            _, dim, ids = next(pending)
            itemsize = 4 if header.dtype is DType.FLOAT32 else 2
            if header.count != len(ids) or header.length != len(ids) * dim * itemsize or header.dtype is not self.dtype:
                raise ProtocolError(f"SPARSE_ROWS of {header.count} rows / {header.length} bytes, expected "
                                    f"{len(ids)} rows of {dim} {self.dtype.name}")
            body = bytearray(header.length)
            link.channel.recv_exact(memoryview(body), deadline_after(client._reply_wait))
            self.bytes_received += header.length
            rows = torch.frombuffer(body, dtype=self.torch_dtype) if header.length else \
                torch.empty(0, dtype=self.torch_dtype)
            out.append(rows.reshape(len(ids), dim).to(torch.float32))
            return header.step

        client._gather(links, MsgType.SPARSE_ROWS, what, client._reply_wait, receive)
        return out

    def push(self, step: int, pushes: Sequence[tuple[int, np.ndarray, torch.Tensor]]) -> None:
        """Each (table index, distinct sorted ids, summed row gradients [n, dim]) for ``step``; waits
        for every ACK (sync: the rows are held until the step's dense update)."""
        client = self.client
        what = f"the ACK of the sparse rows for step {step}"
        links = [self._link()] * len(pushes)
        client._send_all(links[:1], lambda link: [self._send(MsgType.SPARSE_PUSH, step, i, g.shape[1], ids, g)
                                                  for i, ids, g in pushes], what)
        client._gather(links, MsgType.ACK, what, client._reply_wait, lambda link, header: header.step)
