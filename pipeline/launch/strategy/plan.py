"""``shardline plan``: the strategy table for a config on a cluster one assumes (hosts, link rate), without
Spark and without training. The sizing tool to run before asking for a cluster.

The model's bytes come from the config's model on its shard set (``--param-mb`` stands in when there is
none yet); its step from one timed forward/backward on this machine, or, with ``--param-mb``, from the
FLOPs of a dense model (6 x parameters x batch) at this machine's measured matrix-multiply rate. Links
are what the user assumes; the server and local per-byte costs are this machine's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from pipeline.config.auto import AUTO
from pipeline.launch.strategy.cost_model import Probes

log = logging.getLogger(__name__)

STRATEGY_KEYS = ("train.backend", "ps.placement", "ps.mode", "ps.compression")
GBIT = 1e9 / 8


@dataclass(frozen=True)
class Assumed:
    hosts: int
    link_gbit: float
    ranks_per_host: int = 1
    driver_link_gbit: Optional[float] = None  # null: the same as the hosts' links
    param_mb: Optional[float] = None           # the model's fp32 parameters in MB (null: built from the config)
    compute_ms: Optional[float] = None         # a step's forward + backward (null: timed or estimated here)


def open_keys(overrides) -> dict:
    """The config changes that leave every strategy key the command line did not fix to auto."""
    fixed = {o.split("=", 1)[0].strip() for o in overrides}
    changes: dict = {}
    for key in STRATEGY_KEYS:
        if key not in fixed:
            section, name = key.split(".")
            changes.setdefault(section, {})[name] = AUTO
    return changes


def matmul_flops() -> float:
    """This machine's float32 matrix-multiply rate (FLOP/s), one 512x512 product timed."""
    import torch

    from pipeline.launch.strategy.probe_task import typical_s

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return 2 * 512 ** 3 / typical_s(lambda: a @ b, 5)


def _flat_costs(param_bytes: int, topk_ratio: float) -> dict:
    import torch

    from pipeline.launch.strategy.probe_task import flat_costs, typical_s

    n = max(1, min(param_bytes, 64 << 20) // 4)
    flat, momentum = torch.randn(n), torch.zeros(n)
    return {"optimizer_s": typical_s(lambda: momentum.mul_(0.9).add_(flat), 3) * param_bytes / (n * 4),
            **flat_costs(flat, topk_ratio, 3)}


def assumed_probes(cfg, manifest, spec, a: Assumed) -> Probes:
    """Probes for the assumed cluster: the model sized and timed here, the links as assumed."""
    from pipeline.launch.strategy.probes import server_Bps, sparse_costs

    started = time.perf_counter()
    ranks = a.hosts * a.ranks_per_host
    local: dict = {}
    if a.param_mb is not None:
        param_bytes, buffer_bytes = int(a.param_mb * 1e6), 0
        local.update(_flat_costs(param_bytes, cfg.ps.topk_ratio))
        local["compute_s"] = 6 * (param_bytes / 4) * cfg.train.batch_size / matmul_flops()
    else:
        import torch

        from pipeline.launch.strategy.probe_task import local_costs
        from pipeline.launch.strategy.probes import first_batch
        from pipeline.models import build_model, flat_buffers, flat_parameters, loss_fn

        model = build_model(spec)
        param_bytes, buffer_bytes = flat_parameters(model).numel() * 4, flat_buffers(model).numel() * 4
        inputs, labels, local["data_s"] = first_batch(manifest, cfg.train.batch_size)
        local.update(local_costs(model, {k: torch.from_numpy(v.copy()) for k, v in inputs.items()},
                                 torch.from_numpy(labels.copy()), loss_fn(spec), topk_ratio=cfg.ps.topk_ratio,
                                 repeats=3, budget_s=0.3))
        local["sparse_bytes"], local["sparse_rows"], local["sparse_server_s"] = sparse_costs(cfg, spec, inputs)
    if a.compute_ms is not None:
        local["compute_s"] = a.compute_ms / 1e3
    link = a.link_gbit * GBIT
    probes = Probes(ranks=ranks, hosts=a.hosts, ranks_per_host=a.ranks_per_host, param_bytes=param_bytes,
                    buffer_bytes=buffer_bytes, link_Bps=link,
                    driver_Bps=(a.driver_link_gbit * GBIT if a.driver_link_gbit else link),
                    server_Bps=server_Bps(param_bytes, ranks), source="assumed", **local)
    log.info("plan figures in %.1f s", time.perf_counter() - started)
    return probes
