"""The client's bucketed rounds (``ps.overlap``, ``pipeline.worker.buckets``): a mixin of ``PSClient``, apart so
the client module stays about connections and whole-vector steps.

A round sends each shard its slice of the gradient when the caller says it is ready (``send_slice``, from
an autograd hook while backward still runs), then reads every shard's reply in shard order
(``finish_round``), exactly as ``push_pull``/``push`` read them: a shard's ERROR is raised only after the
other shards' replies were read, so every connection stays in step. ``use_params_buffer`` makes PARAMS
land straight in a caller's buffer (the one a model's parameters are views of).
"""
from __future__ import annotations

from typing import Union

import torch

from pipeline.errors import PSError
from pipeline.ps.transport.protocol import MsgType


class BucketRounds:
    """Uses ``PSClient``'s links, encoders, sends and gathers."""

    def use_params_buffer(self, flat: torch.Tensor) -> None:
        """Receive PARAMS straight into ``flat`` (fp32, contiguous, CPU, ``num_params`` values) from now on,
        e.g. the one buffer a model's parameters are views of (``pipeline.worker.buckets``): a pull then
        is the model's parameter load, with no copy after it. Kept across reconnects (same size)."""
        assert self._info is not None
        if flat.dtype != torch.float32 or flat.device.type != "cpu" or not flat.is_contiguous() \
                or flat.numel() != self._info.num_params:
            raise PSError(f"a PARAMS buffer must be a contiguous fp32 CPU tensor of {self._info.num_params} "
                          f"values, got {flat.dtype} {tuple(flat.shape)} on {flat.device}")
        self._params = flat
        self._params_buf = memoryview(flat.detach().numpy()).cast("B")

    def grad_slot(self) -> torch.Tensor | None:
        """The connection's gradient slot as ``num_params`` fp32 values (one shard on this host, pushes
        uncompressed; else None): a gradient computed into it is pushed as a descriptor, with no copy
        (pipeline.wire.shm). Valid for this connection: after a reconnect, pushes from it are copied."""
        links = self._links
        slot = None if len(links) != 1 or links[0].channel.shm is None else links[0].channel.shm.slot_out
        link = links[0] if links else None
        if slot is None or link is None or link.compressor is None or link.compressor.compression != "none" \
                or slot.size < 4 * link.size:
            return None
        return slot.data[:4 * link.size].view(torch.float32)

    def link_ranges(self) -> list[tuple[int, int]]:
        """Each shard's ``[start, end)`` slice, in shard order: the buckets an overlapped push sends."""
        return [(link.start, link.end) for link in self._require()]

    def send_slice(self, index: int, step: int, grad: torch.Tensor, *, pull: bool, first: bool) -> None:
        """Send shard ``index`` its slice of ``grad`` for ``step`` now (PUSH_PULL when ``pull``, else PUSH),
        without waiting for a reply: a bucket goes out as soon as backward produced it. Every shard must
        be sent exactly once per round, then ``finish_round`` reads the replies. ``first``: no other
        shard was sent in this round yet (an encoding error then leaves every stream in sync)."""
        links = self._require()
        assert self._info is not None
        if pull and self._info.mode == "async":
            raise PSError("push_pull is not available in async mode; use push() then pull()")
        link = links[index]
        flat = self._flat_gradient(step, grad)  # no copy for the fp32 CPU buffer a bucketed round sends
        try:
            self._send_gradient([link], MsgType.PUSH_PULL if pull else MsgType.PUSH, flat, step,
                                f"the reply to the gradient for step {step}")
        except PSError:
            if not first and self._links:
                self._drop()
            raise

    def finish_round(self, step: int, *, pull: bool) -> Union[int, tuple[int, torch.Tensor]]:
        """The replies of a round whose every slice ``send_slice`` sent: ``push_pull``'s return value
        when ``pull``, else ``push``'s."""
        links = self._require()
        if self.phase_hook is not None:
            self.phase_hook("push")
        if pull:
            return self._receive_params(links, f"parameters of version >= {step + 1} after the gradient "
                                               f"for step {step}")
        what = f"the ACK of the gradient for step {step}"
        return min(self._gather(links, MsgType.ACK, what, self._reply_wait, lambda link, header: header.step))
