"""The launch probes (driver side): one barrier stage of the run's task count that times a step on a real
batch in every task at once and measures the links (``probe_task``, ``link_probe``), the server's sum and
optimizer step timed here, and the figures cached per cluster and config fingerprint in the workdir.

A cached figure set is used while it is younger than ``train.auto.probe_cache_s``: a run of the same
config on the same master and world size pays no probe at all.
"""
from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any, Optional

from pipeline.errors import PSError
from pipeline.launch.strategy.cost_model import Probes

log = logging.getLogger(__name__)

TRANSFER_BYTES = 4 << 20  # per direction and host: 0.17 s at 200 Mbit/s, past tbf's burst and slow start
MAX_TIMED_BYTES = 64 << 20  # the server's sum is timed on at most this many bytes, and scaled per byte


class ProbeError(PSError):
    """A probe task failed or the link probe got no answer: auto cannot choose without its figures."""


def fingerprint(master: str, workers: int, spec_dict: dict, batch_size: int, manifest_fingerprint: str) -> str:
    text = json.dumps({"master": master, "workers": workers, "model": spec_dict, "batch": batch_size,
                       "data": manifest_fingerprint}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached(folder: Path, key: str, max_age_s: float) -> Optional[Probes]:
    path = folder / f"probes-{key}.json"
    if max_age_s <= 0 or not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if time.time() - float(record["at"]) > max_age_s:
            return None
        return Probes(**{**record["probes"], "source": "cached"})
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring the unreadable probe cache %s (%s); probing again", path, exc)
        return None


def store(folder: Path, key: str, probes: Probes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"probes-{key}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"at": time.time(), "probes": probes.to_dict()}, indent=1))
    tmp.replace(path)


def reader_fields(manifest) -> tuple:
    return manifest.features_field, manifest.label_field, manifest.num_features, manifest.feature_set


def first_batch(manifest, batch_size: int):
    """(inputs, labels, seconds to read a batch) as numpy: the first ``batch_size`` rows of the train split, as
    the loader reads them."""
    from pipeline.launch.strategy.probe_task import read_batch

    try:
        return read_batch(manifest.files("train"), reader_fields(manifest), batch_size)
    except ValueError as exc:
        raise PSError(f"{manifest.root}: {exc}") from None


def batch_rows(spec, inputs: dict) -> dict[str, tuple[Any, Any]]:
    """ps.sparse: each table's module and its distinct ids in one batch (what a step pulls, and pushes gradients
    of): {name: (module, ids)}."""
    import torch

    from pipeline.models import build_model

    model = build_model(spec)
    tables = [m for m in model.modules() if getattr(m, "shardline_sparse", False)]
    seen: dict[str, tuple[Any, Any]] = {}

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def rows(self, module, ids):
            seen[module.spec.name] = (module, ids.cpu().numpy().copy())
            return self.inner.rows(module, ids)

    for table in tables:
        table.source = Recording(table.source)
    if tables:
        with torch.no_grad():
            model({k: torch.from_numpy(v.copy()) for k, v in inputs.items()})
    return seen


def sparse_costs(cfg, spec, inputs: dict) -> tuple[float, float, float]:
    """(bytes of one rank's rows a step, each way; distinct rows; the server's seconds to look them up and
    apply their gradients, one rank's): the batch's ids through real tables of ps.sparse's optimizer."""
    import torch

    from pipeline.launch.sparse_tables import tables_spec
    from pipeline.launch.strategy.probe_task import typical_s
    from pipeline.ps.sparse.table import SparseTable

    seen = batch_rows(spec, inputs)
    if not seen:
        return 0.0, 0.0, 0.0
    sparse = tables_spec(cfg, spec, [module for module, _ in seen.values()])
    tables = {t.name: SparseTable(t, sparse.optimizer, shards=sparse.row_shards, policy=sparse.policy)
              for t in sparse.tables}
    ids_of = {name: ids for name, (_, ids) in seen.items()}
    nbytes = sum(len(ids) * tables[name].spec.dim * 4 for name, ids in ids_of.items())
    step = [0]

    def serve():  # what the server does for one rank's step: its rows looked up, then their gradients applied
        step[0] += 1
        for name, ids in ids_of.items():
            rows = tables[name].lookup(ids, step[0])
            tables[name].apply(ids, torch.ones_like(rows), step[0])

    return float(nbytes), float(sum(len(ids) for ids in ids_of.values())), typical_s(serve, 3)


def server_Bps(param_bytes: int, ranks: int) -> float:
    """The driver's sum of ``ranks`` pushes and one SGD step, per byte of one push (cost_model.Probes)."""
    import torch

    from pipeline.launch.strategy.probe_task import best_of_spells

    n = max(1, min(param_bytes, MAX_TIMED_BYTES) // 4)
    acc, grad, weights, momentum = (torch.zeros(n) for _ in range(4))

    def round_():
        acc.zero_()
        for _ in range(ranks):
            acc.add_(grad)
        momentum.mul_(0.9).add_(acc)
        weights.add_(momentum, alpha=-1e-9)

    return ranks * n * 4 / best_of_spells(round_, 3)


def measure(spark, cfg, manifest, spec, workers: int) -> Probes:
    """The probes of this run: cached, else measured (one barrier stage, ~1 s on a warm cluster)."""
    from pipeline.config.workdir import Workdir
    from pipeline.launch.placement.ps_address import is_local_address, ps_host
    from pipeline.launch.strategy.link_probe import LinkProbeServer
    from pipeline.launch.strategy.probe_task import RESULT_DDL, ProbeWiring, kernel_id, make_probe_fn
    from pipeline.models import build_model, flat_buffers, flat_parameters
    from pipeline.wire.deadline import Timeout

    folder = Workdir.of(cfg).root / "strategy"
    master = str(cfg.spark.master)
    key = fingerprint(master, workers, spec.to_dict(), cfg.train.batch_size, manifest.fingerprint)
    hit = cached(folder, key, cfg.train.auto.probe_cache_s)
    if hit is not None:
        log.info("strategy probes: cached figures of this master, world size and model (%s; "
                 "train.auto.probe_cache_s=0 probes again)", folder / f"probes-{key}.json")
        return hit
    started = time.perf_counter()
    model = build_model(spec)
    param_bytes, buffer_bytes = flat_parameters(model).numel() * 4, flat_buffers(model).numel() * 4
    inputs, _, _ = first_batch(manifest, cfg.train.batch_size)
    secret = secrets.token_bytes(32)
    timeout = Timeout(cfg.timeouts.connect_s or cfg.ps.timeout_s, "timeouts.connect_s")
    with LinkProbeServer(ps_host(spark, cfg), secret, transfer_bytes=TRANSFER_BYTES, timeout=timeout) as server:
        fn = make_probe_fn(ProbeWiring(spec, cfg.train.batch_size, tuple(manifest.files("train")),
                                       reader_fields(manifest), server.address, secret, timeout.seconds,
                                       cfg.ps.topk_ratio))
        spark.addTag("shardline-strategy-probe")
        try:
            rows = [r.asDict() for r in spark.range(0, workers, 1, workers)
                    .mapInArrow(fn, RESULT_DDL, barrier=True).collect()]
        finally:
            spark.removeTag("shardline-strategy-probe")
        rates = server.wait(timeout.seconds)
        failed = {r["rank"]: r["error"] for r in rows if r["error"]}
        if failed or rates is None:
            raise ProbeError("train.backend=auto: the strategy probe failed, so no strategy can be chosen "
                             f"({server.error or failed}); set train.backend and the ps.* keys by hand")
    hosts = {r["host"] for r in rows}
    # ranks on one kernel over its cores (a testbed's namespaces share one machine's): > 1 stretches every
    # step's CPU-bound fixed costs as it does the compute the probe timed
    per_kernel: dict[str, list] = {}
    for r in rows:
        per_kernel.setdefault(r["kernel"], []).append(r)
    oversubscribed = max(len(rs) / max(min(r["cores"] for r in rs), 1) for rs in per_kernel.values())
    rows_bytes, rows_count, rows_server_s = sparse_costs(cfg, spec, inputs)
    probes = Probes(ranks=workers, hosts=len(hosts), ranks_per_host=max(r["ranks_per_host"] for r in rows),
                    param_bytes=param_bytes, buffer_bytes=buffer_bytes,
                    compute_s=max(r["compute_s"] for r in rows), data_s=max(r["data_s"] for r in rows),
                    optimizer_s=max(r["optimizer_s"] for r in rows),
                    link_Bps=rates.link_Bps, driver_Bps=rates.driver_Bps, burst_bytes=rates.burst_bytes,
                    copy_Bps=min(r["copy_Bps"] for r in rows), server_Bps=server_Bps(param_bytes, workers),
                    topk_s_per_byte=max(r["topk_s_per_byte"] for r in rows),
                    cast_s_per_byte=max(r["cast_s_per_byte"] for r in rows),
                    sparse_bytes=rows_bytes, sparse_rows=rows_count, sparse_server_s=rows_server_s,
                    same_host=len(hosts) == 1 and all(is_local_address(h) for h in hosts),
                    cpu_share=max(1.0, oversubscribed),
                    shared_cpu={r["kernel"] for r in rows} == {kernel_id()})
    log.info("strategy probes took %.2f s (the tasks %.2f s, of it the link probe %.2f s): %s",
             time.perf_counter() - started, max(r["task_s"] for r in rows),
             max(r["link_s"] or 0.0 for r in rows), _brief(probes))
    try:
        store(folder, key, probes)
    except OSError as exc:
        log.warning("could not cache the strategy probes in %s: %s", folder, exc)
    return probes


def _brief(p: Probes) -> str:
    return (f"N={p.ranks} on {p.hosts} host(s), M={p.param_bytes / 1e6:.2f} MB, step compute "
            f"{p.compute_s * 1e3:.2f} ms, link {p.link_Bps * 8 / 1e9:.3g} Gbit/s, burst {p.burst_bytes / 1024:.0f} KB, "
            f"driver link {p.driver_Bps * 8 / 1e9:.3g} Gbit/s")

