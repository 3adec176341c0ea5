"""The per-request fast paths of the PS keep the exact semantics of the slow ones: the fused SGD step
is bit-identical to ``torch.optim.SGD``, the first push's overwrite equals zero-then-add, and a
``PUSH_PULL`` round trip gives what ``push`` + ``pull(step + 1)`` give."""
from __future__ import annotations

import threading

import pytest
import torch

from pipeline.errors import PSError
from pipeline.ps import OptimizerSpec
from pipeline.ps.modes.compression import Contribution
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.state.optim import FusedSGD, build_optimizer
from pipeline.ps.transport.protocol import DType, Header, MsgType, tensor_bytes

N = 4099


def _grads(steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(N, generator=g) * 10 ** torch.randint(-6, 3, (N,), generator=g) for _ in range(steps)]
    out[0][:5] = torch.tensor([-0.0, 0.0, 1e-40, -1e-40, 3e38])  # signed zeros, subnormals, huge
    return out


@pytest.mark.parametrize("spec", [
    OptimizerSpec(name="sgd", lr=0.05),
    OptimizerSpec(name="sgd", lr=0.01, momentum=0.9),
    OptimizerSpec(name="sgd", lr=0.3, momentum=0.5, weight_decay=1e-3),
    OptimizerSpec(name="sgd", lr=1e-3, weight_decay=0.1),
])
def test_fused_sgd_is_bit_identical_to_torch_sgd(spec: OptimizerSpec) -> None:
    init = torch.randn(N, generator=torch.Generator().manual_seed(1))
    ref = init.clone().requires_grad_(True)
    mine = init.clone().requires_grad_(True)
    ref_opt, my_opt = build_optimizer(spec, ref), build_optimizer(spec, mine)
    fused = FusedSGD.for_optimizer(my_opt)
    assert fused is not None
    for i, grad in enumerate(_grads(6)):
        if i == 3:  # an lr change through the param group (what load_state_dict does) is honoured
            for opt in (ref_opt, my_opt):
                opt.param_groups[0]["lr"] = spec.lr * 0.5
        ref.grad = grad.clone()
        ref_opt.step()
        g = grad.clone()
        mine.grad = g
        fused.step(mine.detach(), g)
        assert torch.equal(ref.detach().view(torch.int32), mine.detach().view(torch.int32)), f"step {i}"
    if spec.momentum:  # the momentum buffer lives where torch keeps it (checkpoints, fall-back)
        assert torch.equal(ref_opt.state_dict()["state"][0]["momentum_buffer"],
                           my_opt.state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 6, 8, 64])
def test_the_server_step_applies_the_sum_divided_by_the_world_size_bit_for_bit(divisor: int) -> None:
    """Powers of two scale by the reciprocal (a multiply, not a divide): the same bits as ``sum / n``,
    signed zeros, subnormals and huge values included."""
    from pipeline.ps.state.core import ShardCore
    from pipeline.ps.settings import PSSettings

    init = torch.randn(N, generator=torch.Generator().manual_seed(2))
    core = ShardCore(init, PSSettings(optimizer=OptimizerSpec(name="sgd", lr=0.5)), generation=0)
    grad_sum = _grads(1, seed=3)[0] * 1e-3  # 1e-40 * 1e-3 / n: results below the subnormal range as well
    expected = init - 0.5 * (grad_sum / divisor)
    core.optimizer_step(grad_sum.clone(), divisor)
    assert torch.equal(core.flat.detach().view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("divisor", [1, 2, 3, 8])
@pytest.mark.parametrize("spec", [
    OptimizerSpec(name="sgd", lr=0.01, momentum=0.9),  # one kernel: the divide, momentum and step fused
    OptimizerSpec(name="sgd", lr=0.3, momentum=0.5, weight_decay=1e-3),  # the ops: weight decay
])
def test_server_steps_with_momentum_equal_torch_sgd_on_the_averaged_sum_bit_for_bit(spec, divisor,
                                                                                    monkeypatch) -> None:
    """Each update (the first sets the momentum buffer) equals ``torch.optim.SGD`` stepped on ``sum / n``,
    whether one kernel divides as it steps or the sum is divided first; the buffer is where torch keeps it."""
    from pipeline.ps.state import optim
    from pipeline.ps.state.core import ShardCore
    from pipeline.ps.settings import PSSettings

    kernel, calls = optim._ONE_KERNEL, []
    assert kernel is not None  # torch 2.13 has it: the path under test
    monkeypatch.setattr(optim, "_ONE_KERNEL", lambda *a, **k: calls.append(1) or kernel(*a, **k))

    init = torch.randn(N, generator=torch.Generator().manual_seed(4))
    core = ShardCore(init, PSSettings(optimizer=spec), generation=0)
    ref = init.clone().requires_grad_(True)
    ref_opt = build_optimizer(spec, ref)
    for i, grad_sum in enumerate(_grads(5, seed=5)):
        ref.grad = grad_sum / divisor
        ref_opt.step()
        core.optimizer_step(grad_sum.clone(), divisor)
        assert torch.equal(core.flat.detach().view(torch.int32), ref.detach().view(torch.int32)), f"step {i}"
    assert torch.equal(core.optimizer.state_dict()["state"][0]["momentum_buffer"],
                       ref_opt.state_dict()["state"][0]["momentum_buffer"])
    assert len(calls) == (0 if spec.weight_decay else 5)


@pytest.mark.parametrize("size", [58, 64 * 7 + 3, N])
def test_a_server_in_slices_steps_bit_for_bit_as_one(size: int) -> None:
    """Sliced anywhere (ps.shards, ps.bucket_mb), the slices' steps give the one server's bits: no element's
    rounding depends on where its slice ends (the fused kernel's scalar tail would make it)."""
    from pipeline.ps.state.core import ShardCore
    from pipeline.ps.settings import PSSettings

    spec = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9)
    init = torch.randn(size, generator=torch.Generator().manual_seed(6))
    whole = ShardCore(init, PSSettings(optimizer=spec), generation=0)
    cuts = [0, size // 3, size // 3 + 1, size]
    slices = [ShardCore(init[a:b], PSSettings(optimizer=spec), generation=0) for a, b in zip(cuts, cuts[1:])]
    for grad_sum in _grads(4, seed=7):
        grad_sum = grad_sum[:size]
        whole.optimizer_step(grad_sum.clone(), 2)
        for core, a, b in zip(slices, cuts, cuts[1:]):
            core.optimizer_step(grad_sum[a:b].clone(), 2)
    joined = torch.cat([core.flat.detach() for core in slices])
    assert torch.equal(whole.flat.detach().view(torch.int32), joined.view(torch.int32))


def test_fused_sgd_is_only_built_for_plain_sgd() -> None:
    p = torch.zeros(3, requires_grad=True)
    assert FusedSGD.for_optimizer(build_optimizer(OptimizerSpec(name="adam"), p)) is None
    assert FusedSGD.for_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)) is None
    assert FusedSGD.for_optimizer(torch.optim.SGD([p], lr=0.1, maximize=True)) is None


@pytest.mark.parametrize("dtype, wire", [(torch.float32, DType.FLOAT32), (torch.float16, DType.FLOAT16),
                                         (torch.bfloat16, DType.BFLOAT16)])
def test_start_sum_equals_zero_then_add(dtype: torch.dtype, wire: DType) -> None:
    values = _grads(1)[0].clamp(-6e4, 6e4).to(dtype)
    payload = tensor_bytes(values)
    contribution = Contribution(payload, Header(MsgType.PUSH, 1, 0, 0, wire, N, payload.nbytes), N)
    expected = torch.zeros(N)
    contribution.add_to(expected)
    got = torch.full((N,), float("nan"))  # stale content is overwritten, whatever it was
    contribution.start_sum(got)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def _run_ranks(fn, world_size: int) -> None:
    errors: list[BaseException] = []

    def wrap(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("mode, momentum", [("sync", 0.0), ("sync", 0.9), ("ssp", 0.0), ("average", 0.0)])
def test_push_pull_matches_push_then_pull(make_server, make_client, mode: str, momentum: float,
                                          shards: int) -> None:
    steps, world = 4, 2
    grads = {r: _grads(steps, seed=10 + r) for r in range(world)}
    results = {}
    for combined in (False, True):
        server = make_server(torch.linspace(-1, 1, N), world_size=world, shards=shards, timeout_s=10,
                             consistency=Consistency(mode, staleness=1 if mode == "ssp" else 0),
                             optimizer=OptimizerSpec(name="sgd", lr=0.01, momentum=momentum))
        versions: dict[int, list[int]] = {}

        def worker(rank: int) -> None:
            with make_client(server, rank, timeout_s=10) as c:
                info = c.connect()
                start, _ = c.pull(info.clock if mode == "ssp" else 0)
                seen = []
                for step in range(start, start + steps):
                    g = grads[rank][step - start]
                    if combined:
                        version, params = c.push_pull(step, g)
                    else:
                        c.push(step, g)
                        version, params = c.pull(step + 1)
                    seen.append(version)
                versions[rank] = seen
                c.finish()

        _run_ranks(worker, world)
        results[combined] = (server.parameters(), versions, server.version)
    (p0, v0, s0), (p1, v1, s1) = results[False], results[True]
    assert s0 == s1 == steps
    assert torch.equal(p0.view(torch.int32), p1.view(torch.int32))
    if mode != "ssp":  # ssp's answer may be any version within the bound
        assert v0 == v1


def test_push_pull_refusals_keep_the_connection(make_server, make_client) -> None:
    server = make_server(world_size=1)
    with make_client(server, 0) as c:
        c.connect()
        bad = torch.ones(6)
        bad[2] = float("nan")
        with pytest.raises(PSError, match="NaN/Inf"):
            c.push_pull(0, bad)
        with pytest.raises(PSError, match="step 1 but the server is at version 0"):
            c.push_pull(1, torch.ones(6))
        version, params = c.push_pull(0, torch.ones(6))  # still in sync after both refusals
        assert version == 1 and torch.equal(params, torch.arange(6, dtype=torch.float32) - 1.0)
        assert c.pull(1)[0] == 1
        c.finish()


def test_push_pull_is_refused_in_async_mode(make_server, make_client) -> None:
    server = make_server(world_size=1, consistency=Consistency("async"))
    with make_client(server, 0) as c:
        c.connect()
        with pytest.raises(PSError, match="async"):
            c.push_pull(0, torch.ones(6))
        c.push(0, torch.ones(6))
        c.finish()
