"""The allreduce backend's DistributedDataParallel wrapper, with the options that keep its step as cheap as a
plain DDP script's (issue 17: the allreduce loop must not add anything to what DDP itself costs).

Why ``gradient_as_bucket_view=True``: by default DDP copies each gradient into its communication bucket
before the allreduce and the averaged bucket back into ``.grad`` after it, two full copies of the
gradients per step; with views, ``.grad`` *is* the bucket, so the copy back (and the memory of a second
gradient set) goes. The loop sets ``.grad = None`` before each backward; DDP then copies autograd's fresh
gradient into the bucket once and points ``.grad`` at it again (its documented handling of
set-to-none). What reads the gradients after backward (clipping, the fp16 scaler's unscale, the
optimizer) works in place on the views, which torch allows; only ``detach_()`` of a gradient is not.

Buckets keep DDP's default size (``bucket_cap_mb=25``, a first bucket of 1 MB, so the last layers'
allreduce can start while backward still runs); no other size was measured to do better here.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The DDP constructor options of train.backend=allreduce (tests read them back from the wrapper).
DDP_OPTIONS = {"gradient_as_bucket_view": True}


def wrap(model, device: str, *, shared_memory: bool = False, timeout=None):
    """``model`` in DistributedDataParallel over the current default process group (gloo on CPU, nccl on
    CUDA); gradients land averaged over the ranks in ``model``'s ``.grad`` during backward.

    A group of one rank gets ``model`` itself: its gradients are already the average, and DDP would
    still copy them into buckets and run a collective every step for nothing (one loaded run of the
    4.4 MB MLP on CPU: 0.4 CPU s more over 273 steps).

    ``shared_memory`` (train.allreduce_shared_memory, CPU only): when every rank runs on this host, the
    buckets are averaged through /dev/shm (``pipeline.worker.shm_allreduce``) instead of gloo's TCP;
    ``timeout`` (a Timeout: timeouts.step_s) bounds its waits."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.get_world_size() == 1:
        return model
    cuda = str(device).startswith("cuda")
    device_ids = [torch.device(device).index] if cuda else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, **DDP_OPTIONS)
    if shared_memory and not cuda:
        from pipeline.worker.shm_allreduce import join
        from pipeline.wire.deadline import STEP_KEY, Timeout

        hook = join(dist.get_rank(), dist.get_world_size(), timeout or Timeout.of(120.0, STEP_KEY))
        if hook is not None:
            ddp.register_comm_hook(None, hook.comm_hook())
            ddp._shardline_shm_hook = hook  # what tests read to know the hook is in use
            log.debug("rank %d: DDP buckets averaged through shared memory", dist.get_rank())
    return ddp
