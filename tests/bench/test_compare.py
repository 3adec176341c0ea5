"""bench/compare.py's pure parts: parsing the benches' printed figures, noise, verdicts, the table, the
import-marker check. Fed with captured output; no bench runs here, and no timing asserts."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def compare(load_bench):
    return load_bench("compare")


# Captured stdout of bench/ps_bench.py (016be04) with small arguments.
PS_OUT = """\
host: 2 cpus, torch 2.13.0+cpu, python 3.11.7

sync round, 2 worker processes (median ms per step)
  size | (a) PS push+pull | (b) gloo allreduce | (c) TCP round trip |   a/b |   a/c
   1MB |             1.64 |               2.82 |               0.46 |  0.58 |  3.55
   4MB |             8.26 |               3.91 |               1.64 |  2.11 |  5.05

async updates/s, 64 KB model, workers as threads in 2 processes
workers |  1 shard(s) |  2 shard(s) | 2 vs 1
      8 |        1725 |         932 | 0.54x
     32 |         846 |         637 | 0.75x

total 25s
"""

# The async table without shard 2: the ratio column prints "-".
PS_OUT_NO_RATIO = """\
async updates/s, 64 KB model, workers as threads in 2 processes
workers |  1 shard(s) |  4 shard(s) | 2 vs 1
      8 |        1725 |        2932 | -
"""

# Captured stdout of bench/e2e_bench.py (016be04), --rows 20000 --epochs 1.
E2E_OUT = """\
Started distributed training with 2 executor processes
Finished distributed training with 2 executor processes

data: 20000 rows x 64 features, 10 classes; train 13967, test 3055 rows; generate + ETL + warm-up 13.2s, not timed
model: MLP 64-128-10; 2 workers x batch 256 (global 512), 28 steps/epoch x 1 epochs, SGD lr 0.05 momentum 0.9
host: 2 cpus, spark 4.3.0 local[2], torch 2.13.0+cpu; Spark Python workers: torch threads [1, 1], OMP_NUM_THREADS ['1', '1']; warm-up reached Python workers [8233, 8234]

backend                     |  wall s | train samples/s | test acc
----------------------------|---------|-----------------|---------
shardline ps (sync)         |     1.7 |           8,463 | 0.5195
shardline allreduce         |     3.1 |           4,458 | 0.5195
TorchDistributor (DDP gloo) |    13.4 |           1,039 | 0.5195
single-process torch        |     0.1 |         246,600 | 0.5237

shardline ps / TorchDistributor: samples/s 8.15x, wall time 0.12x
shardline allreduce / TorchDistributor: samples/s 4.29x, wall time 0.23x

  shardline ps (sync): 28 steps; slowest worker run() 0.2s of 1.7s wall (PS/driver setup, barrier stage launch, teardown: 1.5s); ranks in Python workers ['vm:8230/8233', 'vm:8230/8234']
  shardline allreduce: 28 steps; slowest worker run() 1.8s of 3.1s wall (PS/driver setup, barrier stage launch, teardown: 1.4s); ranks in Python workers ['vm:8230/8234', 'vm:8230/8233']
  TorchDistributor: 13.4s wall, torch threads per rank 1; rank 0's timeline: 3.0s Spark barrier job -> task starts torchrun wrapper; 1.5s wrapper -> torchrun agent; 2.3s agent (imports torch, rendezvous) -> worker process; 1.3s worker: python + unpickle train_fn; 1.6s imports (torch, pipeline); 0.0s gloo init; 1.2s DDP setup (waits for the other rank) + loader; 0.5s training loop; 2.0s return: exits, result file, Spark collect
  single-process torch: 13967 samples, batch ~498, torch threads 1

total runtime: 40.6s
"""

# Captured stdout of a failing run (44fd02c: train() raised in both shardline rows).
E2E_FAILED = """\
data: 20000 rows x 64 features, 10 classes; train 13967, test 3055 rows; generate + ETL + warm-up 14.6s, not timed

backend                     |  wall s | train samples/s | test acc
----------------------------|---------|-----------------|---------
shardline ps (sync)         |   error |           error | TypeError: WorkerPlan.__init__() got an unexpected keyword argument 'task'
shardline allreduce         |     n/a |             n/a | n/a (train.backend not available)
TorchDistributor (DDP gloo) |    16.6 |             839 | 0.5195
single-process torch        |     0.2 |          89,919 | 0.5237

shardline ps / TorchDistributor: n/a
shardline allreduce / TorchDistributor: n/a

total runtime: 53.1s
"""


def _by_name(figures):
    return {f.name: f for f in figures}


def test_number(compare):
    assert compare._number("12,345") == 12345.0
    assert compare._number(" 1.85x ") == 1.85
    assert compare._number("0.4s") == 0.4
    for text in ("n/a", "error", "-", "x", "n/a (train.backend not available)", "TypeError: 1"):
        assert compare._number(text) is None


def test_parse_ps_bench(compare):
    figures = _by_name(compare.parse_ps_bench(PS_OUT))
    assert len(figures) == 2 * 5 + 2 * 3 + 1
    a = figures["sync 4MB: (a) PS push+pull ms"]
    assert (a.value, a.better, a.kind) == (8.26, "lower", "")
    assert figures["sync 4MB: (b) gloo allreduce ms"].kind == "ref"
    assert figures["sync 1MB: (c) TCP round trip ms"].kind == "ref"
    assert figures["sync 4MB: a/b"].value == 2.11 and figures["sync 4MB: a/b"].better == "lower"
    assert figures["sync 1MB: a/c"].kind == ""
    rate = figures["async 32 workers: 2 shard(s) updates/s"]
    assert (rate.value, rate.better) == (637.0, "higher")
    assert figures["async 8 workers: 2 vs 1 shard(s)"].value == 0.54
    assert figures["total runtime s"].kind == "info" and figures["total runtime s"].value == 25.0


def test_parse_ps_bench_ratio_dash(compare):
    figures = _by_name(compare.parse_ps_bench(PS_OUT_NO_RATIO))
    assert figures["async 8 workers: 4 shard(s) updates/s"].value == 2932.0
    assert figures["async 8 workers: 2 vs 1 shard(s)"].value is None


def test_parse_e2e_bench(compare):
    figures = _by_name(compare.parse_e2e_bench(E2E_OUT))
    assert figures["generate + ETL + warm-up s (untimed prep)"].value == 13.2
    assert figures["shardline ps (sync): wall s"].value == 1.7
    rate = figures["single-process torch: train samples/s"]
    assert (rate.value, rate.better) == (246600.0, "higher")
    assert figures["TorchDistributor (DDP gloo): test acc"].value == 0.5195
    assert figures["shardline ps / TorchDistributor: samples/s x"].value == 8.15
    wall = figures["shardline allreduce / TorchDistributor: wall time x"]
    assert (wall.value, wall.better) == (0.23, "lower")
    assert figures["shardline allreduce: slowest worker run() s"].value == 1.8
    assert figures["shardline ps (sync): PS/driver setup + launch + teardown s"].value == 1.5
    phases = [f for f in figures.values() if f.name.startswith("TorchDistributor rank 0:")]
    assert len(phases) == 9 and all(f.kind == "info" for f in phases)
    assert figures["TorchDistributor rank 0: training loop s"].value == 0.5
    assert figures["total runtime s"].value == 40.6


def test_parse_e2e_bench_failed_rows(compare):
    figures = _by_name(compare.parse_e2e_bench(E2E_FAILED))
    acc = figures["shardline ps (sync): test acc"]
    assert acc.value is None and acc.raw.startswith("TypeError")
    assert figures["shardline allreduce: wall s"].value is None
    assert figures["TorchDistributor (DDP gloo): wall s"].value == 16.6
    assert not any("/ TorchDistributor" in name for name in figures)


def test_noise(compare):
    assert compare.noise([10.0, 11.0, 12.0]) == pytest.approx(2 / 11)
    assert compare.noise([5.0]) is None
    assert compare.noise([]) is None


def test_verdict(compare):
    v = compare.verdict
    # lower is better: worse only beyond the larger noise
    assert v("lower", "", 1.08, 0.10, 0.05) == "~"
    assert v("lower", "", 1.12, 0.10, 0.05) == "WORSE"
    assert v("lower", "", 0.85, 0.10, 0.05) == "better"
    # higher is better
    assert v("higher", "", 0.93, 0.05, 0.10) == "~"
    assert v("higher", "", 0.88, 0.05, 0.10) == "WORSE"
    assert v("higher", "", 1.2, 0.05, 0.10) == "better"
    # no noise estimate (1 repeat), reference and info figures
    assert v("lower", "", 1.01, None, None) == "worse?"
    assert v("lower", "", 1.0, None, None) == "~"
    assert v("lower", "ref", 1.5, 0.1, 0.1) == "ref worse"
    assert v("lower", "info", 5.0, 0.1, 0.1) == ""
    assert v("lower", "", None, 0.1, 0.1) == ""


def _ps(a_ms: float, rate: float) -> str:
    return PS_OUT.replace("8.26", f"{a_ms:.2f}").replace("        846 ", f"{rate:>11.0f} ")


def test_summarize_and_table(compare):
    old = [compare.parse_ps_bench(_ps(a, r)) for a, r in ((8.0, 800), (8.4, 820), (8.2, 840))]
    new = [compare.parse_ps_bench(_ps(a, r)) for a, r in ((9.6, 830), (9.8, 850), (9.7, 810))]
    rows = {r.name: r for r in compare.summarize(old, new)}
    a = rows["sync 4MB: (a) PS push+pull ms"]
    assert (a.old_med, a.new_med) == (8.2, 9.7)
    assert a.ratio == pytest.approx(9.7 / 8.2)
    assert a.old_noise == pytest.approx(0.4 / 8.2) and a.new_noise == pytest.approx(0.2 / 9.7)
    assert a.verdict == "WORSE"
    rate = rows["async 32 workers: 1 shard(s) updates/s"]
    assert (rate.old_med, rate.new_med, rate.verdict) == (820.0, 830.0, "~")
    assert rows["sync 1MB: a/b"].verdict == "~" and rows["sync 1MB: a/b"].old_noise == 0.0
    table = compare.format_table(list(rows.values()), 3, 3, "== ps_bench")
    lines = table.splitlines()
    assert lines[0] == "== ps_bench"
    assert lines[1].split(" | ")[0].strip() == "figure"
    line = next(x for x in lines if x.startswith("sync 4MB: (a) PS push+pull ms"))
    assert [c.strip() for c in line.split(" | ")] == ["sync 4MB: (a) PS push+pull ms", "lower", "8.2", "9.7", "1.183",
                                                      "5%", "2%", "WORSE"]
    assert any(x.startswith("sync 1MB: (b) gloo allreduce ms [ref]") for x in lines)
    assert any(x.startswith("total runtime s [info]") for x in lines)


def test_summarize_missing_and_text_values(compare):
    rows = {r.name: r for r in compare.summarize([compare.parse_e2e_bench(E2E_OUT)] * 2,
                                                 [compare.parse_e2e_bench(E2E_FAILED)] * 2)}
    acc = rows["shardline ps (sync): test acc"]
    assert acc.new_med is None and acc.ratio is None and acc.verdict == ""
    assert acc.new_raw[0].startswith("TypeError")
    ratio = rows["shardline ps / TorchDistributor: samples/s x"]
    assert ratio.new == [] and ratio.verdict == ""
    table = compare.format_table(list(rows.values()), 2, 2)
    line = next(x for x in table.splitlines() if x.startswith("shardline ps (sync): test acc"))
    assert "TypeError" in line
    td = next(x for x in table.splitlines() if x.startswith("TorchDistributor (DDP gloo): wall s"))
    assert [c.strip() for c in td.split(" | ")][2:5] == ["13.4", "16.6", "1.239"]


def test_import_check(compare, tmp_path):
    tree = tmp_path / "old"
    (tree / "pipeline").mkdir(parents=True)
    own, other = str(tree / "pipeline" / "__init__.py"), "/work/main/pipeline/__init__.py"
    good = (f"x\ncompare: executor pipeline={json.dumps([own])}\ncompare: executor udfs="
            f"{json.dumps([str(tree / 'udfs' / '__init__.py')])}\ncompare: driver pipeline={json.dumps(own)}\n")
    assert compare.import_check(good, tree, spark=True) == []
    assert compare.import_check(f"compare: driver pipeline={json.dumps(own)}\n", tree, spark=False) == []
    # the driver is right but Spark's Python workers imported the editable install
    mixed = good.replace(f"executor pipeline={json.dumps([own])}", f"executor pipeline={json.dumps([own, other])}")
    problems = compare.import_check(mixed, tree, spark=True)
    assert len(problems) == 1 and "executor pipeline" in problems[0] and other in problems[0]
    assert "driver pipeline" in compare.import_check(f"compare: driver pipeline={json.dumps(other)}\n", tree, False)[0]
    missing = compare.import_check("compare: executor check failed: Py4JError('x')\n", tree, spark=True)
    assert len(missing) == 3 and "Py4JError" in missing[1]
    # the bench never imported pipeline
    assert compare.import_check("compare: driver pipeline=null\n", tree, spark=False) == [
        f"driver pipeline from [None], not from {tree}"]


def test_bench_args(compare):
    args = compare.bench_args(["ps_bench", "e2e_bench"], ["e2e_bench=--rows 5000 --epochs 1"], ["--x"])
    assert args["e2e_bench"] == ["--rows", "5000", "--epochs", "1", "--x"]
    assert args["ps_bench"] == compare.shlex.split(compare.DEFAULT_ARGS["ps_bench"]) + ["--x"]
    with pytest.raises(SystemExit):
        compare.bench_args(["ps_bench"], ["nope=--x"], [])


def test_first_error(compare):
    log = "Traceback (most recent call last):\n  File x\nTypeError: WorkerPlan.__init__() got an unexpected keyword\n"
    assert compare.first_error(log) == ": TypeError: WorkerPlan.__init__() got an unexpected keyword"
    assert compare.first_error("all fine\n") == ""
