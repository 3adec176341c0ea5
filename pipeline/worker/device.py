"""Which torch device a task trains on, and making it the process's current device.

Spark hands a task a GPU *address* (``TaskContext.resources()["gpu"]``): what the cluster's discovery
script reported, normally the physical index (``nvidia-smi``) or a UUID. torch numbers only the devices
``CUDA_VISIBLE_DEVICES`` leaves visible, in that variable's order, so physical GPU 3 under
``CUDA_VISIBLE_DEVICES=2,3`` is ``cuda:1``; using the address as the ordinal would train on another
task's GPU (or fail). :func:`cuda_ordinal` is that mapping, pure so it is tested without a GPU.

:func:`bind_device` makes the ordinal the current device before anything touches CUDA (the model's
``.to``, pinned host buffers, the NCCL communicator): each of those otherwise creates its context on the
current device, which is GPU 0 until set — every rank of a host would then hold a context on GPU 0.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


def cuda_ordinal(address: str, visible: Optional[str], count: int) -> Optional[int]:
    """torch's CUDA ordinal for Spark's GPU ``address`` given ``CUDA_VISIBLE_DEVICES`` (None: unset) and
    torch's device count; None when the address names no visible device."""
    address = str(address).strip()
    if visible is None:
        ordinal = int(address) if address.isdigit() else None
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if address in entries:
            ordinal = entries.index(address)
        elif count == 1 and len(entries) == 1:
            # An isolating resource manager (YARN, Kubernetes device plugins) exposes only the task's GPU,
            # sometimes renumbered: the one visible device is the one assigned.
            ordinal = 0
        else:
            ordinal = None
    return ordinal if ordinal is not None and 0 <= ordinal < count else None


def choose_device(gpu: Optional[str]) -> str:
    """``cuda:<ordinal>`` for the GPU Spark assigned this task, else ``cpu``.

    No GPU assigned: cpu. A GPU assigned but CUDA unusable in this process: cpu, logged (the allreduce
    rendezvous then refuses a group that mixes cuda and cpu ranks). CUDA usable but the address names no
    visible device: a ConfigError naming the address and ``CUDA_VISIBLE_DEVICES`` — training on a guessed
    GPU would share another task's."""
    if gpu is None:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        log.warning("Spark assigned GPU %s to this task but CUDA cannot be used here (torch.cuda.is_available()="
                    "False); training on cpu", gpu)
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    ordinal = cuda_ordinal(gpu, visible, count)
    if ordinal is None:
        raise ConfigError(f"Spark assigned GPU address {gpu!r} to this task, but it names none of the {count} CUDA "
                          f"device(s) this process sees (CUDA_VISIBLE_DEVICES={visible!r}); check the cluster's "
                          "GPU discovery script (spark.executor.resource.gpu.discoveryScript) and that "
                          "CUDA_VISIBLE_DEVICES lists the addresses it reports")
    return f"cuda:{ordinal}"


def bind_device(device: str) -> None:
    """Make ``device`` this process's current CUDA device (no-op on cpu)."""
    if not str(device).startswith("cuda"):
        return
    import torch

    torch.cuda.set_device(torch.device(device))


def device_kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def mixed_devices_error(kinds: dict[int, str]) -> Optional[str]:
    """The error text when the ranks of one allreduce group do not all train on the same kind of device
    (NCCL needs CUDA on every rank, gloo here runs on cpu): one rank's cpu among cuda ranks would
    otherwise hang the rendezvous until its timeout."""
    if len(set(kinds.values())) <= 1:
        return None
    cpu = sorted(r for r, k in kinds.items() if k == "cpu")
    cuda = sorted(r for r, k in kinds.items() if k == "cuda")
    return (f"the allreduce group mixes devices: rank(s) {cuda} train on CUDA (nccl) but rank(s) {cpu} have no "
            "usable GPU (cpu, gloo); every rank of a group needs the same backend. Give every task a GPU "
            "(spark.task.resource.gpu.amount, a working CUDA on every executor) or none")
