"""Mixed precision and the local optimizer of a worker: autocast, the fp16 GradScaler before a push,
schedules and clipping on the replicas' own optimizer."""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.ps import OptimizerSpec
from pipeline.ps.modes.schedule import ScheduleSpec
from pipeline.worker.precision import LocalOptimizer, Precision


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_bf16_autocasts_the_forward_on_cpu_and_keeps_fp32_parameters():
    model, precision = _model(), Precision("bf16", "cpu")
    with precision.autocast():
        out = model(torch.randn(4, 6))
    assert out.dtype == torch.bfloat16
    precision.backward(out.float().sum())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_fp16_on_a_cpu_worker_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="train.precision=fp16 needs a CUDA device"):
        Precision("fp16", "cpu")


def test_fp16_push_is_unscaled_to_the_true_gradient_and_an_overflow_pushes_nothing():
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    reference = _model()
    torch.nn.functional.cross_entropy(reference(x), y).backward()

    model = _model()
    precision = Precision("fp16", "cpu", allow_cpu_fp16=True)  # the GradScaler logic, testable on CPU
    scale = precision.scaler.get_scale()
    precision.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert model[0].weight.grad.abs().max() > 1000 * reference[0].weight.grad.abs().max()  # scaled
    assert precision.unscale_for_push(model)
    for ours, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-4, atol=1e-6)

    for p in model.parameters():
        p.grad = None
    precision.backward(torch.nn.functional.cross_entropy(model(x), y) * float("inf"))
    assert not precision.unscale_for_push(model)
    assert precision.skipped == 1 and precision.scaler.get_scale() < scale  # backed off


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_local_optimizer_equals_torch_sgd_with_sequential_lr_and_clip_grad_norm(precision):
    from torch.optim import lr_scheduler as S

    steps, clip = 6, 0.3
    spec = OptimizerSpec("sgd", lr=0.5, momentum=0.9, clip_grad_norm=clip,
                         schedule=ScheduleSpec(steps, warmup_steps=2, decay="linear", min_lr_factor=0.1))
    ours_model, ref_model = _model(), _model()
    ours = LocalOptimizer(spec, ours_model.parameters(), Precision(precision, "cpu", allow_cpu_fp16=True))
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9)
    sched = S.SequentialLR(opt, [S.LinearLR(opt, 0.01, 1.0, total_iters=2),
                                 S.LinearLR(opt, 1.0, 0.1, total_iters=steps - 2)], milestones=[2])
    for step in range(steps):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        for m in (ours_model, ref_model):
            m.zero_grad()
        ours.precision.backward(torch.nn.functional.cross_entropy(ours_model(x), y))
        ours.step(step)
        assert ours.lr == pytest.approx(opt.param_groups[0]["lr"])  # the rate this step is applied with
        torch.nn.functional.cross_entropy(ref_model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
        opt.step()
        sched.step()
        assert ours.last_grad_norm == pytest.approx(float(norm), rel=1e-4)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
