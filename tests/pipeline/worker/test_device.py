"""The CUDA path's logic, testable without a GPU: Spark's GPU address to torch's ordinal, one device kind
per allreduce group, the collective backends bound to the task's interface, one host copy of the gradients."""
import os

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.worker.collective_env import bound_interfaces, interface_of
from pipeline.worker.device import bind_device, choose_device, cuda_ordinal, device_kind, mixed_devices_error


@pytest.mark.parametrize("address, visible, count, ordinal", [
    ("0", None, 2, 0), ("1", None, 2, 1), ("2", None, 2, None),  # no CUDA_VISIBLE_DEVICES: the index itself
    ("3", "2,3", 2, 1), ("2", "2,3", 2, 0),  # physical GPU 3 is torch's cuda:1 under CUDA_VISIBLE_DEVICES=2,3
    ("1", "2,3", 2, None),  # not visible to this process: never a guess
    ("GPU-aa", "GPU-bb,GPU-aa", 2, 1),  # UUID addresses
    ("5", "0", 1, 0),  # an isolating manager renumbered the task's only GPU
    ("0", "", 0, None),  # CUDA_VISIBLE_DEVICES="" hides every GPU
])
def test_spark_gpu_addresses_map_through_cuda_visible_devices(address, visible, count, ordinal):
    assert cuda_ordinal(address, visible, count) == ordinal


def test_no_gpu_assigned_or_no_cuda_trains_on_cpu_and_binds_nothing():
    assert choose_device(None) == "cpu"
    if not torch.cuda.is_available():
        assert choose_device("0") == "cpu"
    bind_device("cpu")  # a no-op, never touches CUDA
    assert device_kind("cuda:1") == "cuda" and device_kind("cpu") == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_an_address_naming_no_visible_gpu_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        choose_device("7")


def test_a_group_mixing_cuda_and_cpu_ranks_is_named_before_the_rendezvous():
    assert mixed_devices_error({0: "cuda", 1: "cuda"}) is None
    text = mixed_devices_error({0: "cuda", 1: "cpu", 2: "cuda"})
    assert "rank(s) [0, 2] train on CUDA" in text and "rank(s) [1] have no usable GPU" in text
    from pipeline.launch.task.rendezvous import _group_error

    # Pipeline stage groups: rank r is in the group of r % stages; stage 1's group is all cpu here.
    offers = [{"device": "cuda"}, {"device": "cpu"}, {"device": "cpu"}, {"device": "cpu"}]
    assert "rank(s) [0] train on CUDA" in _group_error(offers, 2, 2)
    assert _group_error(offers, 1, 2) is None


def test_the_backends_socket_interface_is_the_tasks_own_for_the_group_setup_only(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.10") is None
    with bound_interfaces("127.0.0.1", "gloo"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # Spark reuses Python workers
    with bound_interfaces("127.0.0.1", "nccl"):
        assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "NCCL_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's own choice wins
    with bound_interfaces("127.0.0.1", "gloo"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_flat_gradients_packs_every_gradient_in_order_with_zeros_for_missing_ones():
    from pipeline.models.flat import flat_gradients

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model(torch.ones(4, 3)).sum().backward()
    model[1].bias.grad = None
    out = flat_gradients(model)
    expected = torch.cat([model[0].weight.grad.reshape(-1), model[0].bias.grad, model[1].weight.grad.reshape(-1),
                          torch.zeros(1)])
    assert torch.equal(out, expected)


def _device_to_host_copies(fn):
    """How many aten copies move data from an accelerator to the CPU while ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
                src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                dst_cpu = (args[0].device.type == "cpu") if func is torch.ops.aten.copy_.default \
                    else kwargs.get("device", src.device).type == "cpu"
                if src.device.type != "cpu" and dst_cpu:
                    Count.copies += 1
            return func(*args, **kwargs)

    with Count():
        fn()
    return Count.copies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_gpu_gradients_reach_the_host_in_one_transfer():
    from pipeline.models.flat import flat_gradients

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)]).cuda()
    model(torch.ones(2, 8, device="cuda")).sum().backward()
    out = torch.empty(sum(p.numel() for p in model.parameters()))
    assert _device_to_host_copies(lambda: flat_gradients(model, out=out)) == 1
    assert torch.equal(out, torch.cat([p.grad.reshape(-1).cpu() for p in model.parameters()]))
