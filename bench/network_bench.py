"""The network as a measured resource: training on the multi-host testbed (tests/cluster/testbed.py) with
every worker link rate-limited by `tc tbf`, bytes read from the links' own counters.

    sudo .venv/bin/python bench/network_bench.py [--hosts 2 3] [--rates 1gbit 200mbit none] [--models 4.5MB]
        [--backends "ps sync" "ps overlap" ...] [--out table.md]

For each N (one spark-submit application on N testbed hosts, shards written once) and each rate, model
(the 39 KB small MLP and the 4.5 MB communication-bound one: synthetic data, 64 features, hidden [1024,
1024]) and backend (ps sync, ps async, allreduce, ps with ps.tls, ps with top-k), one 2-epoch training;
its second epoch is measured:

* step time: the driver's time between the epoch rows of epoch 1 and 2, over the epoch's steps;
* bytes per step up and down each worker link: /sys/class/net/<veth>/statistics over the same interval,
  against what the design predicts (M model bytes: the PS M up, M down; top-k 2kM up with k the ratio,
  M down; ring allreduce 2M(N-1)/N each way);
* link-bound efficiency: the busiest link's bytes (up + down) / the rate / the step time (1.0: the link
  never idles, if only one direction moved at a time); and the same for its busiest direction alone.

tbf limits each direction of a link separately (a veth is full duplex). The sync PS pushes, then pulls, so
up + down is its bound; a ring allreduce sends and receives at once, so its bound is the busiest
direction, and its up + down figure can pass 1.0. The small model's steps are too short to drain tbf's
burst, so its figures are not link-bound. Shards are read from a local folder every
namespace sees (`workdir_on_every_host`), not the S3 server, so that only training traffic crosses the
links while the counters run. The figures are one run's; the table says on which machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODELS = {"small": [128], "4.5MB": [1024, 1024]}
BACKENDS = {"ps sync": ["train.backend=ps", "ps.mode=sync"],
            "ps async": ["train.backend=ps", "ps.mode=async"],
            "allreduce": ["train.backend=allreduce"],
            "ps tls": ["train.backend=ps", "ps.mode=sync", "ps.tls=true"],
            "ps top-k 1%": ["train.backend=ps", "ps.mode=sync", "ps.compression=topk", "ps.topk_ratio=0.01"],
            # pushes bucket by bucket during backward, each bucket's pull right behind it (issue 17's overlap)
            "ps overlap": ["train.backend=ps", "ps.mode=sync", "ps.overlap=true", "ps.bucket_mb=1"],
            # issue 43: one server shard per worker host (ps.placement=hosts), the driver coordinating
            "ps hosts": ["train.backend=ps", "ps.mode=sync", "ps.placement=hosts"],
            "ps hosts async": ["train.backend=ps", "ps.mode=async", "ps.placement=hosts"],
            # every mode and a compression, each beside its driver-hosted twin (ratios() pairs them up)
            "ps ssp": ["train.backend=ps", "ps.mode=ssp", "ps.staleness=2"],
            "ps hosts ssp": ["train.backend=ps", "ps.mode=ssp", "ps.staleness=2", "ps.placement=hosts"],
            "ps average": ["train.backend=ps", "ps.mode=average", "ps.sync_every=1"],
            "ps hosts average": ["train.backend=ps", "ps.mode=average", "ps.sync_every=1", "ps.placement=hosts"],
            "ps hosts top-k 1%": ["train.backend=ps", "ps.mode=sync", "ps.compression=topk", "ps.topk_ratio=0.01",
                                  "ps.placement=hosts"]}
DEFAULT_BACKENDS = ["ps sync", "ps async", "allreduce", "ps tls", "ps top-k 1%", "ps hosts", "ps hosts async"]
TOPK = 0.01
UNSHAPED = "none"  # --rates none: the veth links as they are (no tbf), for the TLS cost without a rate limit


def predicted_driver_bytes(backend: str, model_bytes: int, n: int) -> float:
    """Bytes a step on the driver's link (both ways): the driver-hosted PS takes N pushes and sends N pulls;
    allreduce and shards on the hosts move no parameter bytes through it (roster, METRICS, checkpoints only)."""
    if backend == "allreduce" or backend.startswith("ps hosts"):
        return 0.0
    up, down = predicted_link_bytes(backend, model_bytes, n)
    return n * (up + down)


def predicted_link_bytes(backend: str, model_bytes: int, n: int) -> tuple[float, float]:
    """(bytes up, bytes down) per step on one worker link, from docs/training.md's table: the PS takes a
    push up and sends a pull down (top-k: ratio x M entries of an int32 index + fp32 value up); a ring
    allreduce sends and receives 2M(N-1)/N each way (reduce-scatter, then all-gather)."""
    push = 2 * TOPK * model_bytes if "top-k" in backend else model_bytes
    if backend == "allreduce":  # ring: reduce-scatter then all-gather
        each = 2 * model_bytes * (n - 1) / n
        return each, each
    if backend.startswith("ps hosts"):
        # a rank pushes the N-1 slices that are not its host's and pulls them back, while its host's shard
        # takes the other ranks' pushes of its slice in and sends their pulls out
        each = (push + model_bytes) * (n - 1) / n
        return each, each
    if backend.startswith("ps top-k"):
        return 2 * TOPK * model_bytes, model_bytes
    return model_bytes, model_bytes


# -- inside the spark-submit application (the driver, root namespace) ------------------------------------
def inside(args) -> None:
    from pipeline.config import load
    from pipeline.launch import train
    from pipeline.session import get_or_create_spark
    from pipeline.shards import steps_per_epoch
    from tests.cluster.testbed import Testbed

    bed = Testbed.load(args.state)
    results = []
    base = [f"workdir={args.workdir}", "workdir_on_every_host=true", "name=netbench", f"parallelism.data={args.n}",
            "data.synthetic.rows=20000", "data.synthetic.features=64", "train.batch_size=256", "train.epochs=2",
            "tracking.log_model=false", "timeouts.step_s=120", "train.checkpoint_every=100000",
            # the epoch marks must be taken as the rows arrive: the guard's best-epoch snapshot (O(M) from
            # each shard with ps.placement=hosts) would run before them and shift the window into the epoch
            "train.divergence.enabled=false"]
    from pipeline.etl import run_etl
    from pipeline.etl.synthetic import generate

    cfg = load(str(REPO / "conf" / "synthetic.yaml"), base)
    spark = get_or_create_spark(cfg.spark)
    generate(spark, cfg.data, cfg.workdir)
    manifest = run_etl(spark, cfg)
    for rate in args.rates:
        bed.shape(None if rate == UNSHAPED else rate)
        for model in args.models:
            hidden = MODELS[model]
            for backend in args.backends:
                overrides = BACKENDS[backend]
                cfg = load(str(REPO / "conf" / "synthetic.yaml"), [*base, f"model.hidden={hidden}", *overrides])
                marks: list[tuple[float, dict]] = []
                before = bed.counters()
                result = train(spark, cfg, manifest, on_epoch=lambda row: marks.append(
                    (time.perf_counter(), bed.counters(), bed.driver_counters(), dict(row))))
                after = bed.counters()
                (t1, c1, d1, _), (t2, c2, d2, last) = marks[-2], marks[-1]
                steps = steps_per_epoch(manifest, args.n, cfg.train.batch_size)
                # rx at the root end of a veth = bytes up from the host; tx = bytes down to it
                per_link = {host: ((c2[host]["rx_bytes"] - c1[host]["rx_bytes"]) / steps,
                                   (c2[host]["tx_bytes"] - c1[host]["tx_bytes"]) / steps) for host in c2}
                used = {h: v for h, v in per_link.items() if sum(v) > 1000}  # the links of hosts that ran ranks
                model_bytes = 4 * int(result.parameters.numel())  # fp32; the MLPs have no buffers
                step_s = (t2 - t1) / steps
                both = max((up + down for up, down in used.values()), default=0.0)
                one_way = max((max(up, down) for up, down in used.values()), default=0.0)
                rate_bytes_s = _bits(rate) / 8 if rate != UNSHAPED else float("nan")
                driver = sum(d2[k] - d1[k] for k in ("rx_bytes", "tx_bytes")) / steps
                # The whole training (setup, both epochs, teardown) over all its steps: a check on the window,
                # which starts when the epoch row reaches the driver (a few steps late if that row is slow)
                total = steps * cfg.train.epochs
                whole = {host: ((after[host]["rx_bytes"] - before[host]["rx_bytes"]) / total,
                                (after[host]["tx_bytes"] - before[host]["tx_bytes"]) / total) for host in used}
                results.append({"n": args.n, "rate": rate, "model": model, "backend": backend, "steps": steps,
                                "step_ms": step_s * 1e3, "model_bytes": model_bytes, "link_bytes": used,
                                # the slowest rank's own clock over the epoch's steps: what the ratios use
                                # (the driver's window starts when the epoch row arrives, later with some
                                # placements than with others)
                                "rank_step_ms": last["epoch_seconds"] / steps * 1e3,
                                "predicted": predicted_link_bytes(backend, model_bytes, args.n),
                                "driver_bytes": driver, "whole_run_link_bytes": whole,
                                "predicted_driver": predicted_driver_bytes(backend, model_bytes, args.n),
                                "efficiency": both / rate_bytes_s / step_s,
                                "duplex_efficiency": one_way / rate_bytes_s / step_s})
                print(f"NETBENCH {json.dumps(results[-1])}", flush=True)
    bed.shape(None)


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor
    raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 1gbit or 200mbit")


# -- the controller (this script run by hand) ----------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"],
                        help="tbf rates (1gbit, 200mbit, ...), or none for the links unshaped")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, choices=list(BACKENDS))
    parser.add_argument("--out", help="also write the markdown table here")
    from _testbed import parse_or_run_inside

    args = parse_or_run_inside(parser, inside)
    if args is None:
        return 0
    from _testbed import run_on_testbed

    code, rows = run_on_testbed(
        __file__, args.hosts, tag="NETBENCH", prefix="sl-netbench-",
        inside_args=lambda bed, root, n: ["--state", bed.root, "--workdir", str(Path(root) / f"work-{n}"), "--n",
                                          str(n), "--rates", *args.rates, "--models", *args.models, "--backends",
                                          *args.backends],
        announce=lambda n: f"{len(args.rates) * len(args.models) * len(args.backends)} trainings", show=_line)
    if code:
        return code
    table = markdown(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


def _mb(pair) -> str:
    return f"{pair[0] / 1e6:.2f}/{pair[1] / 1e6:.2f}"


def _line(row: dict) -> str:
    links = ", ".join(_mb(b) for b in row["link_bytes"].values())
    return (f"N={row['n']} {row['rate']:>7} {row['model']:>5} {row['backend']:<12} step {row['step_ms']:7.1f} ms "
            f"(ranks' clock {row.get('rank_step_ms', float('nan')):.1f}) | "
            f"link MB up/down a step {links} (predicted {_mb(row['predicted'])}; whole run "
            f"{', '.join(_mb(b) for b in row.get('whole_run_link_bytes', {}).values())}) | driver link MB a step "
            f"{row['driver_bytes'] / 1e6:.3f} (predicted {row['predicted_driver'] / 1e6:.2f}) | efficiency "
            f"{row['efficiency']:.2f} (busiest direction {row['duplex_efficiency']:.2f})")


def markdown(rows: list[dict]) -> str:
    head = ("| N | rate | model | backend | step ms (driver's window / ranks' clock) | MB a step up/down, each worker "
            "link (measured) | predicted | the same over the whole run "
            "| driver link MB a step (measured / predicted) | link-bound efficiency (up+down) | busiest direction |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['n']} | {r['rate']} | {r['model']} | {r['backend']} | {r['step_ms']:.1f} / "
        f"{r.get('rank_step_ms', float('nan')):.1f} | "
        f"{' '.join(_mb(b) for b in r['link_bytes'].values())} | {_mb(r['predicted'])} | "
        f"{' '.join(_mb(b) for b in r.get('whole_run_link_bytes', {}).values())} | "
        f"{r['driver_bytes'] / 1e6:.3f} / {r['predicted_driver'] / 1e6:.2f} | "
        f"{r['efficiency']:.2f} | {r['duplex_efficiency']:.2f} |\n" for r in rows)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    return (head + body + ratios(rows) +
            f"\n(one run of `bench/network_bench.py`, {time.strftime('%Y-%m-%d')}, {machine})\n")


def ratios(rows: list[dict]) -> str:
    """Issue 43's figures, each a ratio of two trainings of this run (same N, rate and model)."""
    by = {(r["n"], r["rate"], r["model"], r["backend"]): r for r in rows}
    lines = []

    def ms(r: dict) -> float:
        return r.get("rank_step_ms", r["step_ms"])

    for (n, rate, model, backend), r in sorted(by.items()):
        if backend == "ps hosts":
            ring, driver = by.get((n, rate, model, "allreduce")), by.get((n, rate, model, "ps sync"))
            if ring:
                lines.append(f"- N={n} {rate} {model}: sync PS, shards on the hosts / allreduce, time a step: "
                             f"{ms(r) / ms(ring):.2f}")
            if driver:
                lines.append(f"- N={n} {rate} {model}: sync PS, shards on the hosts / on the driver, time a step: "
                             f"{ms(r) / ms(driver):.2f}")
            lines.append(f"- N={n} {rate} {model}: driver link bytes a step / (M x N), shards on the hosts: "
                         f"{r['driver_bytes'] / (r['model_bytes'] * n):.4f}")
        if backend == "ps hosts async" and (n, rate, model, "ps async") in by:
            driver = by[(n, rate, model, "ps async")]
            lines.append(f"- N={n} {rate} {model}: async updates/s, shards on the hosts / on the driver: "
                         f"{ms(driver) / ms(r):.2f}")
        twin = backend.replace("ps hosts", "ps", 1)
        if backend.startswith("ps hosts ") and backend != "ps hosts async" and (n, rate, model, twin) in by:
            lines.append(f"- N={n} {rate} {model}: {twin[3:]}, time a step, shards on the hosts / on the driver: "
                         f"{ms(r) / ms(by[(n, rate, model, twin)]):.2f}")
    return ("\n" + "\n".join(lines) + "\n") if lines else ""


if __name__ == "__main__":
    sys.exit(main())
