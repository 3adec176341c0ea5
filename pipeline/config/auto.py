"""``train.auto``: what ``train.backend: auto`` (and ``ps.mode`` / ``ps.compression`` / ``ps.placement: auto``)
may choose and how the choice is measured; the chooser itself is ``pipeline.launch.strategy``.

Apart from ``schema`` because it is one concept (the strategy's freedoms and probes) that the train section
only names.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from pipeline.config.section import Section

# The freedoms a user may grant beyond exact synchronous training (allreduce and the sync PS compute the
# same averaged gradient each step; each of these changes what a step computes).
FREEDOMS = ("async", "ssp", "average", "compression")
AUTO = "auto"


class AutoConfig(Section):
    # What auto may choose besides exact-sync strategies: async (ps.mode=async), ssp (ps.mode=ssp),
    # average (ps.mode=average, local SGD), compression (ps.compression fp16/bf16/topk). Default: none.
    allow: list[str] = Field(default_factory=list)
    # Probe figures (a timed step on each task, the link rates) are cached in <workdir>/strategy/ for the same
    # master, world size, model and batch this long; 0: probe every run.
    probe_cache_s: float = Field(86400.0, ge=0)
    # After the first epoch: a WARNING naming the biggest term when the measured step exceeds this x the prediction.
    warn_factor: float = Field(1.5, gt=1)

    @field_validator("allow", mode="before")
    @classmethod
    def _known_freedoms(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else list(value or ())
        unknown = [v for v in items if v not in FREEDOMS]
        if unknown:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))}: train.auto.allow takes any of "
                             f"{', '.join(FREEDOMS)} (or [] for exact-sync strategies only)")
        return list(dict.fromkeys(items))
