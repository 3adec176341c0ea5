"""The strategies ``auto`` chooses between: what each one sets, which semantics it keeps, and which of them a
config leaves open (its ``auto`` keys and ``train.auto.allow``). Pure: no Spark, no torch.

A user's fixed value is never overridden: only keys set to ``auto`` vary. Exact-sync strategies (allreduce
and the sync PS without compression compute the same averaged gradient each step) are always allowed; each
other mode or compression needs its freedom in ``train.auto.allow``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pipeline.config.auto import AUTO

BACKENDS = ("allreduce", "ps")
PLACEMENTS = ("driver", "hosts")  # task only by name: see ps_options' placement comment
MODES = ("sync", "async", "ssp", "average")
COMPRESSIONS = ("none", "fp16", "bf16", "topk")


@dataclass(frozen=True, order=True)
class Candidate:
    backend: str
    placement: Optional[str] = None  # ps only
    mode: Optional[str] = None
    compression: Optional[str] = None

    @property
    def name(self) -> str:
        if self.backend == "allreduce":
            return "allreduce"
        parts = ["ps", self.placement, self.mode]
        if self.compression != "none":
            parts.append(self.compression)
        return " ".join(parts)

    @property
    def freedoms(self) -> tuple[str, ...]:
        """The ``train.auto.allow`` entries this strategy needs (none: exact sync)."""
        needed = []
        if self.backend == "ps" and self.mode != "sync":
            needed.append(self.mode)
        if self.backend == "ps" and self.compression != "none":
            needed.append("compression")
        return tuple(needed)

    def changes(self) -> dict[str, Any]:
        """The config changes (``with_changes`` keywords) that run this strategy."""
        if self.backend == "allreduce":  # the ps keys concrete too: no auto may reach the run
            return {"train": {"backend": "allreduce"},
                    "ps": {"placement": "driver", "mode": "sync", "compression": "none"}}
        return {"train": {"backend": "ps"},
                "ps": {"placement": self.placement, "mode": self.mode, "compression": self.compression}}


def has_auto(cfg) -> bool:
    """Whether any strategy key of ``cfg`` says auto."""
    return AUTO in (cfg.train.backend, cfg.ps.mode, cfg.ps.compression, cfg.ps.placement)


def _choices(value: str, every: tuple[str, ...]) -> tuple[str, ...]:
    return every if value == AUTO else (value,)


def candidates(cfg, allow: Optional[tuple[str, ...]] = None) -> list[Candidate]:
    """Every strategy ``cfg`` leaves open, exact-sync ones first. ``allow``: the freedoms granted (default
    ``cfg.train.auto.allow``). Whether each one is valid for the rest of the config is the chooser's check."""
    granted = set(cfg.train.auto.allow if allow is None else allow)
    user_mode, user_compression = cfg.ps.mode != AUTO, cfg.ps.compression != AUTO
    out: list[Candidate] = []
    for backend in _choices(cfg.train.backend, BACKENDS):
        if backend == "allreduce":
            # allreduce is the exact-sync strategy: open when the ps keys a user fixed say exact sync too.
            if cfg.ps.mode in ("sync", AUTO) and cfg.ps.compression in ("none", AUTO) and \
                    cfg.ps.placement in ("driver", AUTO):
                out.append(Candidate("allreduce"))
            continue
        for placement in _choices(cfg.ps.placement, PLACEMENTS):
            for mode in _choices(cfg.ps.mode, MODES):
                for compression in _choices(cfg.ps.compression, COMPRESSIONS):
                    c = Candidate("ps", placement, mode, compression)
                    # a mode or compression the user fixed by name is theirs; one auto takes needs train.auto.allow
                    if all(f in granted or (user_compression if f == "compression" else user_mode)
                           for f in c.freedoms):
                        out.append(c)
    return sorted(out, key=lambda c: (len(c.freedoms), c))
