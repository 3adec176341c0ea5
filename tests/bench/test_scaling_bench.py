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


def _manifest(shards: int, rows_each: list[int]):
    from pipeline.shards.manifest import Manifest, Shard, ShardFile, SplitShards

    train = tuple(Shard(i, rows_each[i], (ShardFile(f"train/part-{i}.parquet", rows_each[i], 10, (rows_each[i],)),))
                  for i in range(shards))
    test = SplitShards(5, (Shard(0, 5, (ShardFile("test/part-0.parquet", 5, 10, (5,)),)),))
    return Manifest(name="t", task="classification", feature_columns=("x",), label_column="y",
                    label_mapping=("a", "b"), standardized=True, means=(0.0,), stds=(1.0,),
                    splits={"train": SplitShards(sum(rows_each), train), "test": test}, fingerprint="sha256:0",
                    root="/data/set8")


def test_regroup_merges_consecutive_shards_into_n_of_the_same_rows(bench):
    written = _manifest(8, [4, 4, 4, 4, 3, 3, 3, 3])
    four = bench.regroup(written, 4)
    shards = four.split("train").shards
    assert [s.index for s in shards] == [0, 1, 2, 3] and [s.rows for s in shards] == [8, 8, 6, 6]
    assert [f.path for f in shards[1].files] == ["train/part-2.parquet", "train/part-3.parquet"]
    assert four.split("train").rows == 28 and four.files("train") == written.files("train")
    assert four.row_group_rows("train", 3) == [[3], [3]]
    assert four.split("test") == written.split("test") and four.root == written.root
    assert bench.regroup(written, 8).split("train") == written.split("train")
    assert len(bench.regroup(written, 1).split("train").shards[0].files) == 8
    with pytest.raises(ValueError, match=r"8 train shards, which cannot be regrouped into 3.*--workers"):
        bench.regroup(written, 3)
    with pytest.raises(ValueError, match="cannot be regrouped into 16"):
        bench.regroup(written, 16)


def test_the_process_launcher_needs_a_written_shard_set(bench):
    args = bench.parse_args(["--launcher", "processes", "--shards", "/tmp/set8", "--workers", "2", "4", "8",
                             "--ps-shards", "4"])
    assert args.counts == [1, 2, 4, 8] and args.shards == "/tmp/set8"
    assert bench.backend_overrides("ps-processes", args)[-2:] == ["ps.server_processes=true", "ps.shards=4"]
    assert "ps.shards=4" not in bench.backend_overrides("ps", args)
    with pytest.raises(SystemExit):
        bench.parse_args(["--launcher", "processes"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--launcher", "processes", "--shards", "x", "--write-shards", "y"])


@pytest.mark.slow
def test_the_process_launcher_trains_on_a_set_written_by_spark(bench, load_bench, spark, tmp_path, capsys):
    written = str(tmp_path / "set2")
    bench.write_shards(spark, bench.parse_args(["--rows", "3000", "--workers", "2", "--workdir", str(tmp_path / "w"),
                                                "--write-shards", written]))
    args = bench.parse_args(["--launcher", "processes", "--shards", written, "--rows", "3000", "--models", "small",
                             "--batch-size", "32", "--workers", "2", "--workdir", str(tmp_path / "p"),
                             "--repeats", "1"])
    session = load_bench("_process_barrier").ProcessBarrierSession(2)
    try:
        rows = bench.run(session, args)
    finally:
        session.stop()
    assert [(r["n"], r["what"]) for r in rows] == [
        (1, "limit (independent)"), (1, "shardline ps"), (1, "shardline allreduce"),
        (2, "limit (independent)"), (2, "lockstep bound"), (2, "shardline ps"), (2, "shardline allreduce")]
    assert len({r["samples"] for r in rows}) == 1 and rows[0]["samples"] > 0  # every train row once, each N
    assert all(isinstance(r["loop_rate"], float) and r["loop_rate"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "tasks in reused processes" in out and "small  |  2 | shardline ps" in out
