"""bench/strategy_bench.py without a run: its table (auto's pick against the fastest measured, every
prediction's error) and --repredict, the cost model applied again to recorded probes. (Its runs need local
Spark and the multi-host testbed.)"""
GBIT = 1e9 / 8
PROBES = dict(ranks=2, hosts=2, ranks_per_host=1, param_bytes=4_510_000, compute_s=0.012, optimizer_s=0.001,
              link_Bps=0.2 * GBIT, driver_Bps=float("inf"), copy_Bps=1e10, server_Bps=1e10, burst_bytes=262144.0)


def rows():
    measured = {"allreduce": 202.4, "ps driver sync": 380.9, "ps hosts sync": 204.8}
    return [{"scenario": "2 hosts, 200mbit", "model": "4.4MB", "strategy": name, "pick": False, "predicted_ms": 1.0,
             "measured_ms": ms, "probe_s": 1.5, "probes": PROBES} for name, ms in measured.items()]


def test_repredict_applies_the_model_to_the_recorded_probes(load_bench):
    bench = load_bench("strategy_bench")
    again = {r["strategy"]: r for r in bench.repredict(rows())}
    assert set(again) == {"allreduce", "ps driver sync", "ps hosts sync"}
    # the driver's PS moves M up, then M down over a 200 Mbit/s link; the ring both at once
    assert again["ps driver sync"]["predicted_ms"] > 1.8 * again["allreduce"]["predicted_ms"]
    # both move M each way; the host shards' burst counts twice (push and pull): their prediction is lower
    assert [r["strategy"] for r in again.values() if r["pick"]] == ["ps hosts sync"]
    assert again["allreduce"]["measured_ms"] == 202.4  # measurements are kept as they were


def test_the_table_gives_the_pick_against_the_fastest_and_every_error(load_bench):
    bench = load_bench("strategy_bench")
    table = bench.table(bench.repredict(rows()))
    assert "| 2 hosts, 200mbit | 4.4MB | ps hosts sync | allreduce | 1.01 |" in table  # 204.8 / 202.4
    error = abs(next(r for r in bench.repredict(rows()) if r["strategy"] == "ps hosts sync")["predicted_ms"]
                - 204.8) / 204.8
    assert "| 2 hosts, 200mbit | 4.4MB | ps hosts sync | " in table and f"| {100 * error:.0f} % | pick |" in table
