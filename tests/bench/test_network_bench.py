"""bench/network_bench.py's arithmetic: the bytes the design predicts per link and direction, the rate
parser, and the table it prints. (The bench itself needs the multi-host testbed: tests/cluster/ runs it.)"""
import pytest

M = 4_000_000


def test_the_predicted_bytes_are_the_design_tables(load_bench):
    bench = load_bench("network_bench")
    assert bench.predicted_link_bytes("ps sync", M, 2) == (M, M)  # a push up, a pull down
    assert bench.predicted_link_bytes("ps tls", M, 3) == (M, M)  # the same on any N
    assert bench.predicted_link_bytes("allreduce", M, 2) == (M, M)  # 2M(N-1)/N each way
    assert bench.predicted_link_bytes("allreduce", M, 3) == pytest.approx((4 * M / 3, 4 * M / 3))
    assert bench.predicted_link_bytes("ps top-k 1%", M, 2) == pytest.approx((0.02 * M, M))  # index+value up
    # shards on the hosts: a ring's bytes on every worker link, none on the driver's
    assert bench.predicted_link_bytes("ps hosts", M, 3) == pytest.approx((4 * M / 3, 4 * M / 3))
    assert bench.predicted_driver_bytes("ps hosts", M, 3) == 0.0
    # top-k on the hosts: the compressed pushes (2kM) and the full pulls of the slices that cross a link
    assert bench.predicted_link_bytes("ps hosts top-k 1%", M, 2) == pytest.approx((0.51 * M, 0.51 * M))
    assert bench.predicted_link_bytes("ps hosts ssp", M, 2) == bench.predicted_link_bytes("ps hosts", M, 2)
    assert bench.predicted_driver_bytes("ps sync", M, 3) == 6 * M  # N pushes in, N pulls out


def test_rates_read_as_tc_writes_them(load_bench):
    bench = load_bench("network_bench")
    assert bench._bits("1gbit") == 1e9 and bench._bits("200mbit") == 200e6
    with pytest.raises(ValueError, match="give it as tc does"):
        bench._bits("1GB/s")


def test_the_table_has_a_row_per_configuration_with_both_efficiencies(load_bench):
    bench = load_bench("network_bench")
    row = {"n": 2, "rate": "1gbit", "model": "4.5MB", "backend": "ps sync", "step_ms": 95.6,
           "link_bytes": {"198.18.1.11": (4.52e6, 4.51e6)}, "predicted": (4.51e6, 4.51e6), "efficiency": 0.756,
           "duplex_efficiency": 0.378, "driver_bytes": 18.1e6, "predicted_driver": 18.04e6, "model_bytes": 4.51e6}
    hosts = {**row, "backend": "ps hosts", "step_ms": 40.0, "rank_step_ms": 50.0, "driver_bytes": 2e4,
             "predicted_driver": 0.0}
    ring = {**row, "backend": "allreduce", "step_ms": 49.0, "rank_step_ms": 49.0, "driver_bytes": 1e4,
            "predicted_driver": 0.0}
    ssp = {**row, "backend": "ps ssp", "rank_step_ms": 80.0}
    hosts_ssp = {**row, "backend": "ps hosts ssp", "rank_step_ms": 60.0}
    table = bench.markdown([row, hosts, ring, ssp, hosts_ssp])
    assert "ssp, time a step, shards on the hosts / on the driver: 0.75" in table
    assert "| 2 | 1gbit | 4.5MB | ps sync | 95.6 / nan | 4.52/4.51 | 4.51/4.51 |  | 18.100 / 18.04 | 0.76 | 0.38 |" in table
    assert "shards on the hosts / allreduce, time a step: 1.02" in table
    assert "shards on the hosts / on the driver, time a step: 0.52" in table
    assert "driver link bytes a step / (M x N), shards on the hosts: 0.0022" in table
    assert "bench/network_bench.py" in table
