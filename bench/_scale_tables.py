"""What bench/data_scale_bench.py reports from its phase rows: the table of every phase at every size,
the line printed as each one ends, and the ratios between sizes that the targets of issue 47 are
stated in, each marked ok or OVER against its target.

Why ratios and not the figures alone: the question is how memory and time grow with the data, not
what they are on this machine, and a ratio of two runs on one box moves much less with the box. Peak
RSS is held against the smallest size (memory should not grow with the rows at all), time per row
against the size before it (it should stay flat, so each step up is its own check); the command's
wall per row rides along in parentheses, as the step's own clock leaves process and session start-up
out. Pure functions of the rows, so the tests check them on given figures without running anything.

Not a package: bench/ is on sys.path (the benches run as scripts; the tests load it by path).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from _proc_sampler import KINDS

KIND_TITLES = {"driver": "driver py MB", "jvm": "JVM MB", "executor": "executor JVM MB",
               "max_worker": "max worker MB", "workers": "workers MB", "tree": "tree MB"}
RSS_TARGET, CLICKS_RSS_TARGET, TIME_TARGET = 1.2, 1.2, 1.1
MB = 2**20


# -- a phase at a size -------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    """One row of the table: a phase (or the profile / write part of an etl) at one size."""

    pipeline: str
    rows: int  # the size: rows generated
    phase: str  # generate | etl | etl: profile | etl: write | train | evaluate
    counted: int  # the rows its rows/s counts
    seconds: float  # the step's own clock (see bench/data_scale_bench.py's doc)
    wall: float  # the whole command
    cpu: float  # CPU s of the process tree in the step's window (the same as seconds)
    peaks: dict = field(default_factory=dict)  # bytes per kind (KINDS)
    timed_by: str = "log"  # log | command (the step's log line was not found: the command's wall)
    hwm: dict = field(default_factory=dict)  # the kernel's VmHWM per kind (TreeSampler.hwm)
    error: Optional[str] = None
    tree: list = field(default_factory=list, repr=False)  # the command's processes (TreeSampler.tree), first row

    @property
    def rate(self) -> float:
        return self.counted / self.seconds if self.seconds > 0 else 0.0


def label(rows: int) -> str:
    """1000000 -> '1M', 250000 -> '250k', 1500000 -> '1.5M', 1234 -> '1234'."""
    for scale, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if rows >= scale and (rows * 10) % scale == 0:
            return f"{rows / scale:g}{suffix}"
    return str(rows)


def progress_line(r: PhaseResult) -> str:
    if r.error:
        return f"{r.pipeline} {label(r.rows)} {r.phase}: FAILED ({r.error.splitlines()[0]}), log tail:\n{r.error}"
    p = {k: v / MB for k, v in r.peaks.items()}
    return (f"{r.pipeline} {label(r.rows)} {r.phase}: {r.seconds:.1f}s ({r.wall:.1f}s wall), {r.rate:,.0f} rows/s, "
            f"CPU {r.cpu:.0f}s, peak RSS driver {p['driver']:,.0f} / JVM {p['jvm']:,.0f} / max worker "
            f"{p['max_worker']:,.0f} / tree {p['tree']:,.0f} MB")


# -- the report --------------------------------------------------------------------------------------
def kinds_shown(results: list[PhaseResult]) -> list[str]:
    """The RSS columns: executor JVMs only where some were seen (not in local mode)."""
    return [k for k in KINDS if k != "executor" or any(r.peaks.get("executor") for r in results)]


def rows_table(results: list[PhaseResult]) -> tuple[list[str], list[list[str]]]:
    kinds = kinds_shown(results)
    header = ["pipeline", "rows", "phase", "rows counted", "s", "wall s", "rows/s", "CPU s",
              *[KIND_TITLES[k] for k in kinds]]
    body = []
    for r in results:
        if r.error:
            body.append([r.pipeline, label(r.rows), r.phase, f"{r.counted:,}", "failed", f"{r.wall:.1f}", "-", "-",
                         *["-"] * len(kinds)])
            continue
        seconds = f"{r.seconds:.1f}" + ("*" if r.timed_by == "command" else "")
        body.append([r.pipeline, label(r.rows), r.phase, f"{r.counted:,}", seconds,
                     f"{r.wall:.1f}" if r.phase in ("generate", "etl", "train", "evaluate") else "",
                     f"{r.rate:,.0f}", f"{r.cpu:.0f}", *[f"{r.peaks.get(k, 0) / MB:,.0f}" for k in kinds]])
    return header, body


def _by(results: list[PhaseResult], pipeline: str) -> dict[tuple[int, str], PhaseResult]:
    return {(r.rows, r.phase): r for r in results if r.pipeline == pipeline and not r.error}


def _sizes(results: list[PhaseResult], pipeline: str) -> list[int]:
    return sorted({r.rows for r in results if r.pipeline == pipeline})


def _phases(results: list[PhaseResult], pipeline: str) -> list[str]:
    return list(dict.fromkeys(r.phase for r in results if r.pipeline == pipeline))


def ratio_rows(results: list[PhaseResult]) -> list[dict]:
    """The figures the targets need, one dict each: what, pipeline, phase, sizes, kind, value, target."""
    out = []
    kinds = [k for k in kinds_shown(results)]
    for pipeline in ("synthetic", "clicks"):
        by, sizes = _by(results, pipeline), _sizes(results, pipeline)
        if len(sizes) < 2:
            continue
        base = sizes[0]
        for size in sizes[1:]:
            for phase in [*_phases(results, pipeline), "all phases"]:
                for kind in kinds:
                    # issue 47: synthetic, every kind at the largest size / the smallest; clicks, the driver
                    # in the ETL at every size / the smallest
                    if pipeline == "synthetic":
                        target = RSS_TARGET if size == sizes[-1] else None
                    else:
                        target = CLICKS_RSS_TARGET if kind == "driver" and phase.startswith("etl") else None
                    if phase == "all phases":
                        if not all((s, p) in by for s in (base, size) for p in _phases(results, pipeline)):
                            continue
                        top = max(by[(size, p)].peaks[kind] for p in _phases(results, pipeline))
                        bottom = max(by[(base, p)].peaks[kind] for p in _phases(results, pipeline))
                    elif (size, phase) in by and (base, phase) in by:
                        top, bottom = by[(size, phase)].peaks[kind], by[(base, phase)].peaks[kind]
                    else:
                        continue
                    out.append({"what": "peak RSS", "pipeline": pipeline, "phase": phase, "sizes": (size, base),
                                "kind": kind, "value": top / bottom if bottom else None, "target": target})
    for pipeline in ("synthetic", "clicks"):
        by, sizes = _by(results, pipeline), _sizes(results, pipeline)
        for small, big in zip(sizes, sizes[1:]):
            for phase in _phases(results, pipeline):
                if (small, phase) in by and (big, phase) in by:
                    a, b = by[(small, phase)], by[(big, phase)]
                    per_row = (b.seconds / b.counted) / (a.seconds / a.counted) if a.seconds and a.counted and \
                        b.counted else None
                    wall = (b.wall / b.counted) / (a.wall / a.counted) if a.counted and b.counted and a.wall else None
                    # 16M / 4M is issue 47's target; any synthetic pair at least that big is held to it too
                    is_target = pipeline == "synthetic" and big >= 16_000_000 and small >= 4_000_000
                    out.append({"what": "time per row", "pipeline": pipeline, "phase": phase, "sizes": (big, small),
                                "kind": "s", "value": per_row, "wall": wall,
                                "target": TIME_TARGET if is_target else None})
    return out


def ratio_tables(results: list[PhaseResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per ratio table: RSS at each size / the smallest, per pipeline (phase x kind);
    time per row per consecutive pair (phase x pair)."""
    ratios = ratio_rows(results)
    kinds = kinds_shown(results)
    tables = []

    def cell(r: Optional[dict]) -> str:
        if r is None or r["value"] is None:
            return "-"
        text = f"{r['value']:.2f}"
        if r["target"] is not None:
            text += " ok" if r["value"] <= r["target"] else " OVER"
        return text

    for pipeline, target, who in (("synthetic", RSS_TARGET, "every kind at the largest size"),
                                  ("clicks", CLICKS_RSS_TARGET, "the driver in the ETL at every size")):
        rss = [r for r in ratios if r["what"] == "peak RSS" and r["pipeline"] == pipeline]
        if not rss:
            continue
        keyed = {(r["sizes"], r["phase"], r["kind"]): r for r in rss}
        pairs = list(dict.fromkeys(r["sizes"] for r in rss))
        phases = list(dict.fromkeys(r["phase"] for r in rss))
        body = [[f"{label(a)} / {label(b)}", phase, *[cell(keyed.get(((a, b), phase, k))) for k in kinds]]
                for (a, b) in pairs for phase in phases]
        tables.append((f"{pipeline}: peak RSS at each size / at {label(pairs[0][1])} (target <= {target} for {who})",
                       ["sizes", "phase", *[KIND_TITLES[k].replace(" MB", "") for k in kinds]], body))
    per_row = [r for r in ratios if r["what"] == "time per row"]
    if per_row:
        pairs = list(dict.fromkeys((r["pipeline"], r["sizes"]) for r in per_row))
        phases = list(dict.fromkeys(r["phase"] for r in per_row))
        keyed = {(r["pipeline"], r["sizes"], r["phase"]): r for r in per_row}
        body = []
        for pipeline, sizes in pairs:
            row = [pipeline, f"{label(sizes[0])} / {label(sizes[1])}"]
            for phase in phases:
                r = keyed.get((pipeline, sizes, phase))
                row.append("" if r is None else cell(r) + ("" if r["wall"] is None else f" ({r['wall']:.2f})"))
            body.append(row)
        tables.append((f"time per row (the step's s; the command's wall in parentheses) at each size / at the size "
                       f"before it (target <= {TIME_TARGET} for synthetic 16M / 4M)", ["pipeline", "sizes", *phases],
                       body))
    return tables


def plain(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *body)]
    right = [i for i, h in enumerate(header) if i >= 3 or h in ("rows",)]

    def line(cells):
        return " | ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in
                          enumerate(zip(cells, widths)))

    return "\n".join([line(header), "-|-".join("-" * w for w in widths), *[line(b) for b in body]])


def markdown(header: list[str], body: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                      *["| " + " | ".join(str(c) for c in b) + " |" for b in body]])


def report(results: list[PhaseResult], description: str, as_markdown: bool = False, out=print) -> None:
    """``description`` (the run's machine and configs), the table with its notes and the ratio tables;
    with ``as_markdown`` (--markdown) all the tables again as markdown."""
    out("")
    out(description)
    out("")
    header, body = rows_table(results)
    out(plain(header, body))
    notes = ["s: the step's own seconds from its log line (after the process and its Spark session are up), "
             "CPU s: the process tree's in that window; wall s: the whole command; RSS: peaks over the whole command"]
    if any(r.timed_by == "command" for r in results):
        notes.append("*: the step's log line was not found; timed from the Spark session's log line to the "
                     "command's exit")
    notes.append("etl: profile = reading the source and profiling it (clicks: + fitting the vocabularies), "
                 "etl: write = packing and writing the shards, each with the RSS peaks of its own window")
    notes.append("JVM = the driver JVM, which with local[N] is also the executor (no separate executor JVM); "
                 "max worker = the largest single Spark Python worker, workers = their sum at one sample")
    missed = [f"{r.pipeline} {label(r.rows)} {r.phase} {k} +{r.hwm[k] / r.peaks[k] - 1:.0%}" for r in results
              if not r.error and r.phase in ("generate", "etl", "train", "evaluate") for k in r.hwm
              if r.peaks.get(k) and r.hwm[k] > 1.05 * r.peaks[k]]
    notes.append("the kernel's VmHWM is within 5% of every sampled peak" if not missed else
                 "the kernel's VmHWM exceeds the sampled peak (a spike between samples; try --interval 0.1): "
                 + ", ".join(missed))
    for n in notes:
        out("  " + n)
    tables = ratio_tables(results)
    for title, h, b in tables:
        out("")
        out(title)
        out(plain(h, b))
    if as_markdown:
        out("")
        out("markdown:")
        out("")
        out(markdown(header, body))
        for title, h, b in tables:
            out("")
            out(f"*{title}*")
            out("")
            out(markdown(h, b))
