"""bench/train_options_bench.py on a tiny model and vector: every option steps, the report prints every
ratio. No timing asserts."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("train_options_bench")


def test_one_command_prints_every_option_side_by_side(bench, capsys):
    result = bench.main(["--features", "8", "--hidden", "16", "--batch", "8", "--params", "1000", "--steps", "4",
                         "--repeat", "1"])
    out = capsys.readouterr().out
    assert set(result["worker_ratio"]) == {"plain", "schedule", "clip", "bf16", "bf16+clip+schedule"}  # no fp16 on CPU
    assert set(result["server_ratio"]) == {"plain", "schedule", "clip"}
    assert result["worker_ratio"]["plain"] == 1.0 and all(r > 0 for r in result["worker_ratio"].values())
    for option in ("schedule", "clip", "bf16", "best-epoch snapshot"):
        assert option in out


def test_the_server_stepper_really_clips_and_schedules(bench):
    step, core = bench.server_stepper("clip+schedule", params=100, steps=8)
    before = core.flat.detach().clone()
    step()
    assert core.last_grad_norm is not None and core.last_grad_norm > 1.0  # clipped from above the bound
    assert (core.flat.detach() - before).norm() > 0
    assert core.optimizer.param_groups[0]["lr"] != 0.01  # the schedule set the step's rate
