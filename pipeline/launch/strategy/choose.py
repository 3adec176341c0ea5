"""The choice: every open strategy's predicted step, the fastest valid one picked, the table that says why,
and the check of the prediction against the first epoch."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from pipeline.errors import ConfigError
from pipeline.launch.strategy.candidates import Candidate, candidates, has_auto
from pipeline.launch.strategy.cost_model import CONSTANTS, Prediction, Probes, predict

log = logging.getLogger(__name__)


@dataclass
class Row:
    candidate: Candidate
    prediction: Optional[Prediction] = None
    why_not: Optional[str] = None  # set when the rest of the config rules the candidate out


@dataclass
class Decision:
    pick: Candidate
    rows: list[Row]
    probes: Probes
    config: object = field(repr=False, default=None)  # the config that runs the pick

    @property
    def predicted(self) -> Prediction:
        return next(r.prediction for r in self.rows if r.candidate == self.pick)

    def table(self) -> str:
        """Markdown: each candidate's predicted step and terms, the pick marked, the ruled-out ones with why."""
        lines = ["| strategy | predicted step ms | speed ÷ the pick's | terms (ms) |", "|---|---|---|---|"]
        fastest = self.predicted.step_s
        for row in sorted(self.rows, key=lambda r: (r.prediction is None, r.prediction.step_s if r.prediction else 0)):
            mark = " **(pick)**" if row.candidate == self.pick else ""
            if row.prediction is None:
                lines.append(f"| {row.candidate.name} | - | - | not possible here: {row.why_not} |")
                continue
            terms = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in row.prediction.terms.items() if v > 0)
            lines.append(f"| {row.candidate.name}{mark} | {row.prediction.step_s * 1e3:.2f} | "
                         f"{fastest / row.prediction.step_s:.2f} | {terms} |")
        p = self.probes
        lines.append("")
        lines.append(f"Probes ({p.source}): N={p.ranks} ranks on {p.hosts} host(s) ({p.ranks_per_host} a host), "
                     f"M={p.param_bytes / 1e6:.3f} MB, forward+backward {p.compute_s * 1e3:.2f} ms, link "
                     f"{p.link_Bps * 8 / 1e9:.3g} Gbit/s, driver link " + (
                         "not limiting" if p.driver_Bps == float("inf") else f"{p.driver_Bps * 8 / 1e9:.3g} Gbit/s")
                     + (", every rank on the driver's host" if p.same_host else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"pick": self.pick.name, "probes": self.probes.to_dict(),
                "candidates": [{"strategy": r.candidate.name, "changes": r.candidate.changes(),
                                "predicted_step_s": r.prediction.step_s if r.prediction else None,
                                "terms_s": r.prediction.terms if r.prediction else None, "why_not": r.why_not}
                               for r in self.rows]}

    def check_first_epoch(self, measured_step_s: float, factor: float) -> Optional[str]:
        """The WARNING text when the measured step exceeds ``factor`` x the prediction, else None."""
        predicted = self.predicted
        if measured_step_s <= factor * predicted.step_s:
            return None
        term = predicted.biggest
        return (f"train.backend=auto picked {self.pick.name} for a predicted {predicted.step_s * 1e3:.2f} ms step; "
                f"the first epoch measured {measured_step_s * 1e3:.2f} ms ({measured_step_s / predicted.step_s:.1f}x, "
                f"over train.auto.warn_factor={factor:g}). The biggest predicted term is {term} "
                f"({predicted.terms[term] * 1e3:.2f} ms): it is the first figure to check (a busy host, a slower "
                f"link than probed, or a model whose step varies); train.auto.probe_cache_s=0 measures again")


def decide(cfg, probes: Probes) -> Decision:
    """Pure: predict every candidate ``cfg`` leaves open, rule out what the rest of the config cannot run,
    and pick the fastest; one within ``Constants.prefer_within`` of it with fewer freedoms wins (allreduce,
    then the driver's PS, then the host shards: the order ``candidates`` lists them in)."""
    from pipeline.config.loader import with_changes
    from pipeline.launch.sparse_tables import check_supported

    rows: list[Row] = []
    configs = {}
    for candidate in candidates(cfg):
        try:
            concrete = with_changes(cfg, **candidate.changes())
            if probes.sparse_bytes:
                check_supported(concrete)
        except ConfigError as exc:
            rows.append(Row(candidate, why_not=str(exc).splitlines()[-1].strip()))
            continue
        configs[candidate] = concrete
        rows.append(Row(candidate, predict(candidate, probes, topk_ratio=cfg.ps.topk_ratio,
                                           sync_every=cfg.ps.sync_every)))
    possible = [r for r in rows if r.prediction is not None]
    if not possible:
        raise ConfigError("train.backend/ps.* auto: no strategy the config leaves open can run it:\n" +
                          "\n".join(f"  {r.candidate.name}: {r.why_not}" for r in rows) +
                          "\nset train.backend and the ps.* keys by hand, or widen train.auto.allow")
    fastest = min(r.prediction.step_s for r in possible)
    # candidates() lists the fewest freedoms first: the first within the margin of the fastest is the pick
    best = next(r for r in possible if r.prediction.step_s <= fastest * (1 + CONSTANTS.prefer_within))
    return Decision(best.candidate, rows, probes, configs[best.candidate])


def choose_strategy(spark, cfg, manifest, spec, workers: int) -> tuple[object, Optional[Decision]]:
    """(the config to run, the decision); ``cfg`` itself and None when no strategy key says auto."""
    if not has_auto(cfg):
        return cfg, None
    from pipeline.launch.strategy.probes import measure

    decision = decide(cfg, measure(spark, cfg, manifest, spec, workers))
    log.info("train.backend=auto picked %s (predicted %.2f ms a step):\n%s", decision.pick.name,
             decision.predicted.step_s * 1e3, decision.table())
    return decision.config, decision
