"""Learning-rate schedules and gradient clipping on the parameter server: equal to torch's own
schedulers and clip_grad_norm_ on the same steps, over real sockets."""
from __future__ import annotations

import threading

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.ps import OptimizerSpec, PSClient
from pipeline.ps.modes.schedule import ScheduleSpec, StepSchedule

TOTAL = 40


def torch_reference(spec: ScheduleSpec, lr: float, steps: int) -> list[float]:
    """The rates torch's SequentialLR(LinearLR warmup, then the decay) gives on steps 0..steps-1."""
    from torch.optim import lr_scheduler as S

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    decay_steps = spec.total_steps - spec.warmup_steps
    decay = {"cosine": lambda: S.CosineAnnealingLR(opt, T_max=decay_steps, eta_min=spec.min_lr_factor * lr),
             "linear": lambda: S.LinearLR(opt, 1.0, spec.min_lr_factor, total_iters=decay_steps),
             "step": lambda: S.StepLR(opt, spec.step_size, spec.gamma),
             "none": lambda: S.ConstantLR(opt, 1.0, total_iters=1)}[spec.decay]()
    if spec.warmup_steps:
        warm = S.LinearLR(opt, spec.warmup_start_factor, 1.0, total_iters=spec.warmup_steps)
        sched = S.SequentialLR(opt, [warm, decay], milestones=[spec.warmup_steps])
    else:
        sched = decay
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


SPECS = [ScheduleSpec(TOTAL, warmup_steps=5, decay="cosine", min_lr_factor=0.1),
         ScheduleSpec(TOTAL, warmup_steps=0, decay="cosine"),
         ScheduleSpec(TOTAL, warmup_steps=8, decay="linear", min_lr_factor=0.05, warmup_start_factor=0.2),
         ScheduleSpec(TOTAL, warmup_steps=3, decay="step", step_size=7, gamma=0.5),
         ScheduleSpec(TOTAL, warmup_steps=10, decay="none")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.decay}-warmup{s.warmup_steps}")
def test_the_schedule_equals_torch_sequential_lr_on_every_step(spec):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    schedule = StepSchedule(opt, spec)
    ours = [schedule.at(step) for step in range(TOTAL)]
    torch.testing.assert_close(ours, torch_reference(spec, 0.3, TOTAL), rtol=1e-9, atol=1e-12)
    # set, not counted: asking for an earlier step again (a resumed server) gives that step's rate
    assert schedule.at(2) == ours[2] and opt.param_groups[0]["lr"] == ours[2]


def test_a_bad_decay_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="train.schedule.decay"):
        ScheduleSpec(10, decay="exponential")


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    return 5 * torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank))


def _run(server, secret, world: int, steps: int, n: int) -> None:
    def rank_loop(rank: int) -> None:
        host, port = server.address
        with PSClient(host, port, rank=rank, secret=secret, timeout_s=5.0) as c:
            c.connect()
            for step in range(steps):
                c.pull(step)
                c.push(step, _grad(rank, step, n))
            c.pull(steps)
            c.finish()

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive()


@pytest.mark.parametrize("clip", [None, 0.5])
def test_sync_server_steps_equal_torch_sgd_with_sequential_lr_and_clip_grad_norm(make_server, secret, clip):
    n, world, steps = 30, 2, 12
    spec = ScheduleSpec(steps, warmup_steps=3, decay="cosine", min_lr_factor=0.1)
    initial = torch.randn(n, generator=torch.Generator().manual_seed(3))
    server = make_server(initial, world_size=world, optimizer=OptimizerSpec(
        "sgd", lr=0.2, momentum=0.9, schedule=spec, clip_grad_norm=clip))
    _run(server, secret, world, steps, n)

    ref = initial.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.2, momentum=0.9)
    rates = torch_reference(spec, 0.2, steps)
    for step in range(steps):
        ref.grad = torch.stack([_grad(r, step, n) for r in range(world)]).mean(0)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([ref], clip)
        opt.param_groups[0]["lr"] = rates[step]
        opt.step()
    torch.testing.assert_close(server.parameters(), ref.detach())


def test_clipping_bounds_the_applied_update_by_lr_times_max_norm(make_server, secret):
    # plain SGD: the applied update is lr * the clipped averaged gradient, so |old - new| <= lr * max_norm
    n, world, lr, clip = 40, 2, 0.1, 0.25
    initial = torch.zeros(n)
    server = make_server(initial, world_size=world, optimizer=OptimizerSpec("sgd", lr=lr, clip_grad_norm=clip))
    _run(server, secret, world, 1, n)
    update = (initial - server.parameters()).norm().item()
    mean = torch.stack([_grad(r, 0, n) for r in range(world)]).mean(0)
    assert mean.norm().item() > 10 * clip  # the gradient is far over the bound: clipping did the work
    assert update == pytest.approx(lr * clip, rel=1e-5)


def test_a_restored_server_uses_the_rate_of_its_version(make_server, secret):
    n, steps = 8, 10
    spec = ScheduleSpec(steps, warmup_steps=0, decay="step", step_size=2, gamma=0.5)
    first = make_server(torch.zeros(n), world_size=1, optimizer=OptimizerSpec("sgd", lr=1.0, schedule=spec))
    _run(first, secret, 1, 5, n)
    state = first.state_dict()
    resumed = make_server(torch.zeros(n), world_size=1, optimizer=OptimizerSpec("sgd", lr=1.0, schedule=spec))
    resumed.load_state_dict(state)
    before = resumed.parameters()

    host, port = resumed.address
    with PSClient(host, port, rank=0, secret=secret, timeout_s=5.0) as c:
        c.connect()
        c.push(5, torch.ones(n))
        _, after = c.pull(6)
        c.finish()
    # step 5 of a step-2 decay: lr = 0.5 ** 2
    torch.testing.assert_close(before - after, torch.full((n,), 0.25))
