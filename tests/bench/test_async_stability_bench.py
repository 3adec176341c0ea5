"""bench/async_stability_bench.py reduced for CI: 2 seeds (one with a straggler) of digits in async and ssp
with the default staleness rules reach the bench's accuracy bar; the full 10-seed run is the bench."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("async_stability_bench")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_two_seeds_of_digits_reach_the_bar_with_the_default_rules(spark, bench, tmp_path, mode):
    from pipeline.config import load

    # 8 epochs instead of 20: enough to show a collapse (the unstable setting fell apart by epoch 7-14).
    base = load(REPO / "conf" / "digits.yaml", [f"ps.mode={mode}", f"workdir={tmp_path}", "train.epochs=8",
                                                "tracking.log_model=false", "tracking.system_metrics_interval_s=null"])
    lines = []
    runs = bench.stability_runs(spark, base, 2, lines.append)
    assert [r["seed"] for r in runs] == [0, 1] and runs[1]["straggler"] is not None
    assert len(lines) == 3
    for run in runs:
        assert run["accuracy"] >= 0.9, runs
    # No assert on the staleness seen: whether the two ranks overlap at all is the scheduler's (on a loaded
    # 2-core box one rank can finish before the other connects, staleness 0). The staleness rules themselves
    # are tested deterministically on a real PS in tests/pipeline/ps/modes/test_staleness.py.
