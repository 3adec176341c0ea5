"""bench/hosts_modes_bench.py's table: each mode's hosts run beside its driver run, the difference in points.
(The bench itself needs the multi-host testbed.)"""


def test_each_mode_pairs_its_hosts_run_with_its_driver_run(load_bench):
    bench = load_bench("hosts_modes_bench")
    rows = [{"n": 2, "mode": "async", "placement": p, "accuracy": a} for p, a in (("hosts", 0.9611), ("driver", 0.9583))]
    rows.append({"n": 3, "mode": "sync", "placement": "hosts", "accuracy": 0.97})  # no driver twin: no line
    table = bench.table(rows)
    assert "| 2 | async | 0.9611 | 0.9583 | +0.28 |" in table
    assert "| 3 | sync |" not in table
    assert set(bench.MODES) == {"sync", "ssp", "async", "average"}
    repeated = [{"n": 3, "mode": "ssp", "placement": p, "accuracy": a}
                for p, a in (("hosts", 0.85), ("driver", 0.86), ("hosts", 0.87), ("driver", 0.84))]
    assert "| 3 | ssp | 0.8600 (0.8500–0.8700, 2 runs) | 0.8500 (0.8400–0.8600, 2 runs) | +1.00 |" in bench.table(repeated)
