"""A model's parameters and gradients as views into two flat buffers, and gradient buckets pushed while
backward still runs (``ps.overlap``, issue 17 items 2 and 3).

Why flat views (``FlatModel``): the parameter server stores, sums and ships one flat fp32 vector. With
every parameter a view into one buffer the client receives PARAMS into (``PSClient.use_params_buffer``),
a pull *is* the parameter load; with every ``.grad`` a view into one flat gradient buffer, autograd
accumulates straight into what is pushed, so there is no gradient flatten either. Zeroing that buffer
(one memset) replaces ``p.grad = None``: a ``None`` grad would make autograd allocate a fresh tensor and
the view would be lost. ``intact()`` checks the views still hold (a user hook may replace a ``.grad``);
if not, the caller falls back to copying.

Why buckets are the server's shard slices (``BucketPusher``): each shard of the parameter server already
owns a contiguous slice with its own connection, thread, sum and optimizer, so "reduce and apply per
bucket on the server" and "pull per bucket" are what shards do; the driver cuts the parameters into
``ps.bucket_mb`` slices (``pipeline.ps.settings.PSSettings.bucket_bytes``). What overlap adds is *when*
a slice goes out: a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``, what DDP's
reducer uses) counts the parameters of each slice as autograd finishes them — in reverse parameter
order, so the last slice fills first — and sends the slice's PUSH_PULL (PUSH in async) the moment its
last gradient lands, while backward goes on with the earlier layers. After backward, ``flush`` sends
what is left (slices whose parameters got no gradient: zeros, as ``flat_gradients`` gives) and the
replies are read. The numbers are those of the non-overlapped step: same slices, same sums, only sent
earlier. A NaN loss therefore reaches the server before the loop's own finite check: the server's
per-push finite check refuses it (kind ``nonfinite``), as it refuses any non-finite gradient.

Why overlap is off by default and the views are not: the views only remove copies; overlap moves the
server's receive/reduce/step into the workers' backward, which pays only where the server has cores of
its own. With 2 workers and the PS on 2 cores it made backward slower by more than the push it hid.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def writes_own_parameters(model) -> bool:
    """Whether a forward pass of ``model`` writes its parameters in place: ``nn.Embedding`` and
    ``nn.EmbeddingBag`` with ``max_norm`` renormalize the looked-up rows of their weight."""
    import torch

    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None
               for m in model.modules())


class FlatModel:
    """``model``'s parameters (``model.parameters()`` order) as views of ``params``, their gradients as
    views of ``grad``. Only for CPU fp32 models (``bindable``)."""

    def __init__(self, model, grad=None) -> None:
        import torch

        self.parameters = list(model.parameters())
        total = sum(p.numel() for p in self.parameters)
        self.params = torch.empty(total, dtype=torch.float32)
        # ``grad``: where the gradients are to lie instead, e.g. the connection's slot (PSClient.grad_slot).
        fits = grad is not None and grad.numel() == total and grad.dtype == torch.float32
        self.grad = grad.zero_() if fits else torch.zeros(total, dtype=torch.float32)
        self.offsets: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in self.parameters:
                n = p.numel()
                self.params[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.params[offset:offset + n].view_as(p)
                p.grad = self.grad[offset:offset + n].view_as(p)
                self.offsets.append((offset, offset + n))
                offset += n
        self._pointers = [p.grad.data_ptr() for p in self.parameters]
        # A pull that lies elsewhere is bound unless the model writes its own parameters every step
        # (nn.Embedding max_norm): on the server's page (pipeline.wire.shared_page) each such write
        # copies a page that the next pull must drop again; a copy of the pull is cheaper then.
        self.binds = not writes_own_parameters(model)

    @staticmethod
    def bindable(model) -> bool:
        parameters = list(model.parameters())
        return bool(parameters) and all(p.device.type == "cpu" and p.dtype.is_floating_point and
                                        p.dtype.itemsize == 4 and not p.is_sparse for p in parameters)

    def zero_grad(self) -> None:
        self.grad.zero_()

    def intact(self) -> bool:
        """Whether every ``.grad`` is still the view into ``grad`` (so ``grad`` holds this step's gradient)."""
        return all(self.intact_at(i) for i in range(len(self.parameters)))

    def intact_at(self, index: int) -> bool:
        grad = self.parameters[index].grad
        return grad is not None and grad.data_ptr() == self._pointers[index]

    def bind_params(self, flat) -> None:
        """The parameters become views of ``flat`` (``params``' size, fp32, CPU) instead: a pull that lies
        elsewhere (the shared-memory ring, ``PSClient.pull``) is then loaded with no copy."""
        for p, (start, end) in zip(self.parameters, self.offsets):
            p.data = flat[start:end].view_as(p)
        self.params = flat

    def rebind_grads(self) -> None:
        """Gradients back into views of ``grad`` (after something replaced them), values kept (zeros
        where a parameter has no gradient, as ``pipeline.models.flat.flat_gradients`` gives)."""
        import torch

        with torch.no_grad():
            for p, (start, end) in zip(self.parameters, self.offsets):
                view = self.grad[start:end]
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)
        self._pointers = [p.grad.data_ptr() for p in self.parameters]


class BucketPusher:
    """Sends each of the client's shard slices of ``flat.grad`` as soon as autograd has produced every
    gradient in it (see module docstring). ``arm(step)`` before backward; ``flush()`` after it."""

    def __init__(self, client, flat: FlatModel, *, pull: bool) -> None:
        self.client = client
        self.flat = flat
        self.pull = pull
        self.ranges = client.link_ranges()
        # Which slices each parameter's [start, end) touches, and how many parameters each slice waits for.
        self.touches: list[list[int]] = []
        self.needed = [0] * len(self.ranges)
        for start, end in flat.offsets:
            hit = [i for i, (lo, hi) in enumerate(self.ranges) if start < hi and end > lo]
            self.touches.append(hit)
            for i in hit:
                self.needed[i] += 1
        self.left = list(self.needed)
        self.sent = [False] * len(self.ranges)
        self.broken = False
        self.step: int | None = None
        self.early = 0  # slices sent during backward, this epoch (observability)
        self._handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))
                         for i, p in enumerate(flat.parameters)]

    def arm(self, step: int) -> None:
        self.step = step
        self.left = list(self.needed)
        self.sent = [False] * len(self.ranges)
        self.broken = False

    def _ready(self, index: int) -> None:
        if self.step is None or self.broken:  # a backward outside a step (none today), or a replaced .grad
            return
        if not self.flat.intact_at(index):  # this gradient is not in the flat buffer: flush() copies it
            self.broken = True
            return
        for i in self.touches[index]:
            self.left[i] -= 1
            if self.left[i] == 0:
                self._send(i)
                self.early += 1

    def _send(self, i: int) -> None:
        assert self.step is not None
        first = not any(self.sent)
        self.sent[i] = True  # before sending: a failed send must not be retried by flush
        self.client.send_slice(i, self.step, self.flat.grad, pull=self.pull, first=first)

    def flush(self):
        """Send every slice not sent yet, then read the round's replies (``finish_round``)."""
        step, self.step = self.step, None
        assert step is not None, "flush() without arm()"
        if not self.flat.intact():  # a replaced .grad (its slice was held back): into the flat buffer
            self.flat.rebind_grads()
        self.step = step
        for i, done in enumerate(self.sent):
            if not done:
                self._send(i)
        self.step = None
        return self.client.finish_round(step, pull=self.pull)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
