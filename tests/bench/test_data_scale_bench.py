"""bench/data_scale_bench.py: sizes as the CLI reads them (fast), and the whole bench run tiny: every phase
of the synthetic pipeline (20k rows) and of the click ETL (5k rows, a 1,000-id vocabulary) as real CLI
commands (slow). The sampler and the tables have tests of their own (test_proc_sampler.py,
test_scale_tables.py). No timing asserts."""
from __future__ import annotations

import json
import time

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("data_scale_bench")


def test_sizes_parse_with_suffixes(bench):
    assert [bench.parse_rows(t) for t in ("250k", "1.5M", "16M", "20000", "1e6", "2_000")] == \
        [250_000, 1_500_000, 16_000_000, 20_000, 1_000_000, 2_000]
    assert bench.parse_sizes("16M,1M,4M,1M") == [1_000_000, 4_000_000, 16_000_000]
    assert bench.parse_sizes("none") == []
    args = bench.parse_args(["--big", "--clicks-rows", "none"])
    assert args.synthetic_sizes == [1_000_000, 4_000_000, 16_000_000, 32_000_000] and args.clicks_sizes == []
    assert bench.parse_args([]).clicks_sizes == [250_000, 2_000_000, 8_000_000]
    with pytest.raises(SystemExit):
        bench.parse_args(["--synthetic-rows", "none", "--clicks-rows", "none"])


@pytest.mark.slow
def test_one_tiny_run_measures_every_phase_of_every_size(bench, tmp_path, capsys):
    out = tmp_path / "out.json"
    parent = tmp_path / "work"
    started = time.monotonic()
    rc = bench.main(["--synthetic-rows", "20k", "--clicks-rows", "5k", "--clicks-vocab", "1000",
                     "--workdir", str(parent), "--markdown", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    data = json.loads(out.read_text())
    got = {(r["pipeline"], r["rows"], r["phase"]): r for r in data["results"]}
    expected = [("synthetic", 20_000, p) for p in ("generate", "etl", "etl: profile", "etl: write", "train",
                                                   "evaluate")]
    expected += [("clicks", 5_000, p) for p in ("generate", "etl", "etl: profile", "etl: write")]
    assert sorted(got) == sorted(expected)
    for key, r in got.items():
        assert r["error"] is None, key
        assert r["timed_by"] == "log", key  # every step's own log line was found
        assert r["seconds"] > 0 and r["wall"] >= r["seconds"] and r["rate"] > 0, key
        assert r["wall"] < time.monotonic() - started
        for kind in ("driver", "jvm", "max_worker", "workers", "tree"):
            assert r["peaks"][kind] > 0, (key, kind)
        assert r["peaks"]["tree"] >= r["peaks"]["driver"] + r["peaks"]["jvm"] - 1, key
    assert got[("synthetic", 20_000, "generate")]["counted"] == 20_000
    assert 0 < got[("synthetic", 20_000, "train")]["counted"] < 20_000  # the train split's rows, one epoch
    assert 0 < got[("synthetic", 20_000, "evaluate")]["counted"] < 20_000  # the test split's
    # the process tree as pyspark builds it: the CLI's Python -> the JVM -> pyspark.daemon -> its workers
    tree = got[("synthetic", 20_000, "train")]["tree"]
    driver = next(p for p in tree if p["kind"] == "driver")
    jvm = next(p for p in tree if p["kind"] == "jvm")
    assert jvm["ppid"] == driver["pid"]
    assert any(p["kind"] == "worker" and p["ppid"] == jvm["pid"] for p in tree)  # the daemon
    assert not any(p["kind"] == "executor" for p in tree)  # local mode: the JVM is the executor
    for row in ("| synthetic | 20k | train |", "| clicks | 5k | etl: write |"):
        assert row in printed
    assert list(parent.iterdir()) == []  # each size's workdir removed (no --keep)
