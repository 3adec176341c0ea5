"""bench/scaling_bench.py: the table's ratios from given rows (fast), and the whole bench run tiny on the
test session (slow: two shard sets, two limits, four train() calls). No timing asserts."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("scaling_bench")


def test_the_table_prints_each_rate_against_the_limit_and_one_process(bench):
    rows = [{"model": "comm", "n": 1, "one": 1000.0, "what": "limit (independent)", "samples": 10, "wall_rate": "-",
             "loop_rate": 1000.0, "limit": 1000.0, "ratio": 1.0, "cpu_per_k": 2.0},
            {"model": "comm", "n": 2, "one": 1000.0, "what": "limit (independent)", "samples": 10, "wall_rate": "-",
             "loop_rate": 1800.0, "limit": 1800.0, "ratio": 1.0, "cpu_per_k": 2.0},
            {"model": "comm", "n": 2, "one": 1000.0, "what": "shardline allreduce", "samples": 10,
             "wall_rate": 900.0, "loop_rate": 1440.0, "limit": 1800.0, "ratio": 0.8, "cpu_per_k": 2.5},
            {"model": "comm", "n": 2, "one": 1000.0, "what": "shardline ps", "samples": 0, "wall_rate": "error",
             "loop_rate": "error", "limit": 1800.0, "ratio": None, "cpu_per_k": "-"}]
    lines = bench.table(rows).splitlines()
    assert "÷ limit" in lines[0] and "÷ 1 process" in lines[0] and "efficiency" in lines[0]
    cells = [[c.strip() for c in line.split("|")] for line in lines[2:]]
    assert cells[1][5:8] == ["1.00", "1.80", "0.90"]  # the limit of 2: 1.8 x one process, 90% efficient
    assert cells[2][3:8] == ["900", "1,440", "0.80", "1.44", "0.72"]
    assert cells[3][3:6] == ["error", "error", "-"]


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
    assert [(r["n"], r["what"]) for r in rows] == [(n, what) for n in (1, 2) for what in
                                                   ("limit (independent)", "shardline ps", "shardline allreduce")]
    # every row trained every train row once (1 epoch), the limit's N processes together too
    assert len({r["samples"] for r in rows}) == 1 and rows[0]["samples"] > 0
    assert all(isinstance(r["loop_rate"], float) and r["loop_rate"] > 0 for r in rows)
    assert all(isinstance(r["wall_rate"], float) for r in rows if r["what"] != "limit (independent)")
    out = capsys.readouterr().out
    assert "small  |  2 | shardline allreduce" in out and "÷ limit" in out
