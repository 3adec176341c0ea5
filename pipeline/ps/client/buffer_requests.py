"""The client's model-buffer requests (``pipeline.ps.state.buffers`` keeps them on the server): a mixin of
``PSClient``, apart so the client module stays about connections and steps."""
from __future__ import annotations

import torch

from pipeline.errors import PSError, ProtocolError
from pipeline.ps.transport.protocol import Header, MsgType
from pipeline.wire.deadline import deadline_after


class BufferRequests:
    """BUFFERS / PULL_BUFFERS over shard 0's link (uses ``PSClient``'s links, sends and gathers)."""

    def push_buffers(self, step: int, words: torch.Tensor) -> None:
        """Send this rank's model buffers (fp32 words, ``pipeline.models.state``) to shard 0, which keeps
        them, and wait for its ACK. Only for a server that announced ``buffer_words``."""
        links = self._require()[:1]
        expected = self._buffer_words("push")
        flat = words.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
        if flat.numel() != expected:
            raise PSError(f"rank {self.rank} has {flat.numel()} buffer words, the server keeps {expected}; "
                          "driver and workers built different models")
        what = "the ACK of this rank's buffers"
        self._send_all(links, lambda link: link.channel.send_tensor(
            MsgType.BUFFERS, flat, generation=self.generation, rank=self.rank, step=step,
            timeout=self.timeout_s), what)
        self._gather(links, MsgType.ACK, what, self.step_timeout, lambda link, header: header.step)

    def pull_buffers(self) -> torch.Tensor:
        """The server's merged model buffers (a new fp32 tensor of ``buffer_words`` words)."""
        links = self._require()[:1]
        expected = self._buffer_words("pull")
        out = bytearray(expected * 4)
        what = "the merged model buffers"

        def receive(link, header: Header) -> int:
            if header.count != expected:
                raise ProtocolError(f"BUFFERS of {header.count} words from the server, expected {expected}")
            link.channel.recv_into(header, out, deadline_after(self.step_timeout))
            return header.step

        self._send_all(links, lambda link: link.channel.send_empty(
            MsgType.PULL_BUFFERS, generation=self.generation, rank=self.rank, timeout=self.timeout_s), what)
        self._gather(links, MsgType.BUFFERS, what, self.step_timeout, receive)
        return torch.frombuffer(out, dtype=torch.float32, count=expected) if expected else torch.empty(0)

    def _buffer_words(self, verb: str) -> int:
        assert self._info is not None
        if not self._info.buffer_words:
            raise PSError(f"rank {self.rank} cannot {verb} model buffers: the server keeps none")
        return self._info.buffer_words

