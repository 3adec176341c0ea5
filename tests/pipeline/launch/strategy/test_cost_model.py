"""The cost model on recorded probe figures: the predictions against measured steps, and the ranking
flipping where the benches say it does."""
import pytest

from pipeline.config import load
from pipeline.launch.strategy import Candidate, Probes, decide, predict

GBIT = 1e9 / 8
MB44 = 4_510_000  # the 4.4 MB MLP (64 -> 1024 -> 1024 -> 10), fp32 bytes
AUTO_ALL = ["train.backend=auto", "ps.placement=auto", "ps.mode=auto", "ps.compression=auto"]


def probes(**changes) -> Probes:
    # recorded on the 2-core sandbox and its testbed (bench/strategy_bench.py probes, 2026-12-06)
    base = dict(ranks=2, hosts=2, ranks_per_host=1, param_bytes=MB44, compute_s=0.025, optimizer_s=0.0012,
                link_Bps=GBIT, driver_Bps=8 * GBIT, copy_Bps=6e9, server_Bps=4e9, topk_s_per_byte=3e-9,
                cast_s_per_byte=2e-10)
    return Probes(**{**base, **changes})


def step_ms(name: str, p: Probes, **kw) -> float:
    backend, *rest = name.split()
    c = Candidate("allreduce") if backend == "allreduce" else Candidate("ps", rest[0], rest[1],
                                                                        rest[2] if len(rest) > 2 else "none")
    return predict(c, p, **kw).step_s * 1e3


@pytest.mark.parametrize("name,measured_ms", [("ps driver sync", 93.8), ("allreduce", 56.2), ("ps hosts sync", 55.8),
                                              ("ps driver async", 93.5), ("ps hosts async", 58.8)])
def test_two_hosts_at_1_gbit_within_a_quarter_of_network_bench(name, measured_ms):
    # docs/benchmarks.md, "Shards on the workers' hosts": the ranks' clocks of the same 2-host run
    assert abs(step_ms(name, probes()) - measured_ms) / measured_ms <= 0.25


def test_two_hosts_at_200_mbit_the_driver_ps_pays_push_then_pull():
    slow = probes(link_Bps=0.2 * GBIT, driver_Bps=1.6 * GBIT)
    assert step_ms("ps driver sync", slow) == pytest.approx(383.3, rel=0.25)  # network_bench, 200mbit
    assert step_ms("allreduce", slow) == pytest.approx(201.9, rel=0.25)


def test_the_4_4mb_mlp_over_1_gbit_links_flips_to_allreduce():
    cfg = load("conf/digits.yaml", AUTO_ALL)
    decision = decide(cfg, probes())
    assert decision.pick.name in ("allreduce", "ps hosts sync")
    assert step_ms("ps driver sync", probes()) / step_ms("allreduce", probes()) > 1.5  # measured 1.76


def test_the_4_4mb_mlp_on_one_host_is_about_even():
    one = probes(hosts=1, ranks_per_host=2, same_host=True, link_Bps=80e9 / 8, driver_Bps=80e9 / 8)
    ratio = step_ms("ps driver sync", one) / step_ms("allreduce", one)
    assert 0.8 <= ratio <= 1.25


def test_a_small_mlp_on_one_host_picks_allreduce():
    small = probes(hosts=1, ranks_per_host=2, same_host=True, param_bytes=39_000, compute_s=0.0009,
                   optimizer_s=0.00004, link_Bps=80e9 / 8, driver_Bps=80e9 / 8)
    decision = decide(load("conf/digits.yaml", ["train.backend=auto"]), small)
    assert decision.pick.name == "allreduce"
    assert step_ms("ps driver sync", small) > step_ms("allreduce", small)


def test_a_users_fixed_backend_is_kept_even_when_slower():
    decision = decide(load("conf/digits.yaml", ["train.backend=ps", "ps.placement=auto"]), probes())
    assert {r.candidate.name for r in decision.rows} == {"ps driver sync", "ps hosts sync"}
    assert decision.pick.name == "ps hosts sync"
    assert decision.config.train.backend == "ps" and decision.config.ps.placement == "hosts"


def test_compression_only_when_allowed_and_topk_pays_on_a_slow_link():
    slow = probes(link_Bps=0.2 * GBIT, driver_Bps=0.2 * GBIT * 8)
    exact = decide(load("conf/digits.yaml", ["train.backend=ps", "ps.compression=auto"]), slow)
    assert exact.pick.name == "ps driver sync"
    free = decide(load("conf/digits.yaml", ["train.backend=ps", "ps.compression=auto",
                                            "train.auto.allow=[compression]"]), slow)
    assert free.pick.compression in ("fp16", "bf16", "topk")
    assert free.predicted.step_s < exact.predicted.step_s


def test_what_the_config_cannot_run_is_ruled_out_with_the_reason():
    cfg = load("conf/digits.yaml", [*AUTO_ALL, "train.early_stopping.enabled=true"])
    decision = decide(cfg, probes())
    ruled = {r.candidate.name: r.why_not for r in decision.rows if r.prediction is None}
    assert "early_stopping" in ruled["allreduce"]
    assert decision.pick.backend == "ps"
    sparse = decide(load("conf/digits.yaml", AUTO_ALL), probes(sparse_bytes=200_000.0))
    assert "allreduce would move whole tables" in {r.candidate.name: r.why_not for r in sparse.rows}["allreduce"]
    assert "sparse rows" in sparse.predicted.terms


def test_the_table_lists_every_candidate_and_marks_the_pick():
    decision = decide(load("conf/digits.yaml", [*AUTO_ALL, "train.auto.allow=[async]"]), probes())
    table = decision.table()
    for row in decision.rows:
        assert f"| {row.candidate.name}" in table
    assert f"| {decision.pick.name} **(pick)** |" in table
    record = decision.to_dict()
    assert record["pick"] == decision.pick.name and len(record["candidates"]) == len(decision.rows)


def test_a_step_over_the_warn_factor_names_the_biggest_term():
    decision = decide(load("conf/digits.yaml", AUTO_ALL), probes(link_Bps=0.2 * GBIT))
    predicted = decision.predicted.step_s
    assert decision.check_first_epoch(1.4 * predicted, 1.5) is None
    warning = decision.check_first_epoch(2.0 * predicted, 1.5)
    assert warning and "train.auto.warn_factor=1.5" in warning
    assert f"biggest predicted term is {decision.predicted.biggest}" in warning


def test_sixteen_hosts_at_10_gbit_with_a_100_mb_model_spread_the_server():
    big = probes(ranks=16, hosts=16, param_bytes=100_000_000, compute_s=0.4, optimizer_s=0.03,
                 link_Bps=10 * GBIT, driver_Bps=10 * GBIT)
    driver, hosts, ring = (step_ms(n, big) for n in ("ps driver sync", "ps hosts sync", "allreduce"))
    assert driver > 4 * hosts  # 16 pushes and pulls through one 10 Gbit/s link
    # both move 2M(N-1)/N over each link; the host shards' fan-out costs the stretch measured at H=3
    assert ring < hosts < 1.6 * ring


def test_a_shapers_burst_hides_a_small_models_bytes_but_not_a_big_ones():
    slow = dict(link_Bps=0.2 * GBIT, driver_Bps=1.6 * GBIT, burst_bytes=256 * 1024)
    # the testbed's driver sits behind an unshaped bridge: only the hosts' links are shaped
    small = predict(Candidate("ps", "driver", "sync", "none"), probes(param_bytes=39_000, **{**slow, "driver_Bps": 8e9}))
    # what is left is the driver link's own 2 x 39 KB at 1 GB/s
    assert small.terms["push"] + small.terms["pull"] + small.terms["burst"] == pytest.approx(2 * 2 * 39_000 / 8e9)
    big = predict(Candidate("ps", "driver", "sync", "none"), probes(**slow))
    # once a step in each direction: 2 x 256 KB at 25 MB/s
    assert big.terms["burst"] == pytest.approx(-2 * 256 * 1024 / (0.2 * GBIT))
    ring = predict(Candidate("allreduce"), probes(**slow))
    assert ring.terms["burst"] == pytest.approx(-256 * 1024 / (0.2 * GBIT))  # both directions at once


def test_ranks_sharing_cores_stretch_the_cpu_work_not_the_bytes():
    alone = predict(Candidate("ps", "driver", "sync", "none"), probes())
    crowded = predict(Candidate("ps", "driver", "sync", "none"), probes(cpu_share=1.5))
    assert crowded.terms["loop"] == pytest.approx(1.5 * alone.terms["loop"])
    assert crowded.terms["round"] == pytest.approx(1.5 * alone.terms["round"])
    assert crowded.terms["compute"] == pytest.approx(1.5 * alone.terms["compute"])  # the least crowded spell, shared
    assert crowded.terms["push"] == alone.terms["push"]


def test_async_on_the_ranks_cpus_pays_every_ranks_server_work():
    own = predict(Candidate("ps", "driver", "async", "none"), probes(sparse_bytes=1e5, sparse_server_s=0.007))
    shared = predict(Candidate("ps", "driver", "async", "none"),
                     probes(sparse_bytes=1e5, sparse_server_s=0.007, shared_cpu=True))
    assert own.terms["sparse server"] == pytest.approx(0.007)
    assert shared.terms["sparse server"] == pytest.approx(2 * 0.007)


def test_sparse_terms_are_there_with_or_without_a_burst():
    for burst in (0.0, 256 * 1024):
        terms = predict(Candidate("ps", "driver", "sync", "none"),
                        probes(sparse_bytes=6e5, sparse_rows=3500, sparse_server_s=0.007, burst_bytes=burst)).terms
        assert terms["sparse client"] > 0 and terms["sparse server"] == pytest.approx(2 * 0.007), terms
        assert ("burst" in terms) == bool(burst)
