"""bench/scaling_bench.py: the table's ratios from given rows (fast), and the whole bench run tiny on the
test session (slow: two shard sets, two limits, four train() calls). No timing asserts."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("scaling_bench")


def test_the_table_prints_each_rate_against_the_limit_and_one_process(bench):
    # per_one: the median over rounds of each rate ÷ that round's one process (measure() computes it)
    rows = [{"model": "comm", "n": 1, "what": "limit (independent)", "samples": 10, "wall_rate": "-",
             "loop_rate": 1000.0, "limit": 1000.0, "ratio": 1.0, "per_one": 1.0, "cpu_per_k": 2.0},
            {"model": "comm", "n": 2, "what": "limit (independent)", "samples": 10, "wall_rate": "-",
             "loop_rate": 1800.0, "limit": 1800.0, "ratio": 1.0, "per_one": 1.8, "cpu_per_k": 2.0},
            {"model": "comm", "n": 2, "what": "shardline allreduce", "samples": 10,
             "wall_rate": 900.0, "loop_rate": 1440.0, "limit": 1800.0, "ratio": 0.8, "per_one": 1.44, "cpu_per_k": 2.5},
            {"model": "comm", "n": 2, "what": "shardline ps", "samples": 0, "wall_rate": "error",
             "loop_rate": "error", "limit": 1800.0, "ratio": None, "cpu_per_k": "-"},
            # ÷ one process is the rounds' own ratio, not loop_rate ÷ an earlier one-process rate (1440 / 1000)
            {"model": "comm", "n": 2, "what": "shardline ps", "samples": 10, "wall_rate": 900.0,
             "loop_rate": 1440.0, "limit": 1800.0, "ratio": 0.8, "per_one": 1.6, "cpu_per_k": 2.5}]
    lines = bench.table(rows).splitlines()
    assert "÷ limit" in lines[0] and "÷ 1 process" in lines[0] and "efficiency" in lines[0]
    cells = [[c.strip() for c in line.split("|")] for line in lines[2:]]
    assert cells[1][5:8] == ["1.00", "1.80", "0.90"]  # the limit of 2: 1.8 x one process, 90% efficient
    assert cells[2][3:8] == ["900", "1,440", "0.80", "1.44", "0.72"]
    assert cells[3][3:6] == ["error", "error", "-"]
    assert cells[4][5:8] == ["0.80", "1.60", "0.80"]


def test_the_lockstep_bound_pays_each_steps_slowest_process(load_bench):
    limit = load_bench("_common").Limit
    # steps (1, 3) and (3, 1) s: 8 s of work, 6 s if every step waits for its slower process
    jittery = limit(processes=2, samples=4, span_s=4.0, cpu_s=8.0, loop_s=[4.0, 4.0], step_s=[[1.0, 3.0], [3.0, 1.0]])
    assert jittery.lockstep == pytest.approx(4.0 / 6.0)
    steady = limit(processes=2, samples=4, span_s=4.0, cpu_s=8.0, loop_s=[4.0, 4.0], step_s=[[2.0, 2.0], [2.0, 2.0]])
    assert steady.lockstep == pytest.approx(1.0)
    # the steps both processes ran (the shortest's), the i-th paired with the i-th
    uneven = limit(processes=2, samples=5, span_s=5.0, cpu_s=9.0, loop_s=[5.0, 4.0],
                   step_s=[[1.0, 1.0, 3.0], [2.0, 2.0]])
    assert uneven.lockstep == pytest.approx(3.0 / 4.0)
    one = limit(processes=1, samples=2, span_s=2.0, cpu_s=2.0, loop_s=[2.0], step_s=[[1.0, 1.0]])
    assert one.lockstep is None
    assert limit(processes=2, samples=0, span_s=0.0, cpu_s=0.0, loop_s=[0.0, 0.0], step_s=[[], []]).lockstep is None


def test_worker_counts_always_include_one_and_size_the_session(bench):
    args = bench.parse_args(["--workers", "8", "4"])
    assert args.counts == [1, 4, 8] and args.master == "local[8]"
    assert bench.parse_args([]).counts == [1, 2]
    with pytest.raises(SystemExit):
        bench.parse_args(["--workers", "0"])


@pytest.mark.slow
def test_one_tiny_run_measures_every_row(bench, spark, tmp_path, capsys):
    args = bench.parse_args(["--rows", "3000", "--models", "small", "--batch-size", "32", "--workers", "2",
                             "--workdir", str(tmp_path), "--repeats", "1"])
    rows = bench.run(spark, args)
    assert [(r["n"], r["what"]) for r in rows] == [
        (1, "limit (independent)"), (1, "shardline ps"), (1, "shardline allreduce"),
        (2, "limit (independent)"), (2, "lockstep bound"), (2, "shardline ps"), (2, "shardline allreduce")]
    bound = rows[4]
    assert 0 < bound["ratio"] <= 1 and bound["loop_rate"] <= rows[3]["loop_rate"] * (1 + 1e-9)
    # every row's ÷ one process is a median of per-round ratios; at N=1 it is the ratio to the limit itself
    assert all(r["per_one"] > 0 for r in rows) and all(r["per_one"] == r["ratio"] for r in rows[:3])
    # every row trained every train row once (1 epoch), the limit's N processes together too
    assert len({r["samples"] for r in rows}) == 1 and rows[0]["samples"] > 0
    assert all(isinstance(r["loop_rate"], float) and r["loop_rate"] > 0 for r in rows)
    assert all(isinstance(r["wall_rate"], float) for r in rows if r["what"].startswith("shardline"))
    out = capsys.readouterr().out
    assert "small  |  2 | shardline allreduce" in out and "÷ limit" in out
