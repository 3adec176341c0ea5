"""Data scale: each phase of the synthetic pipeline and the click ETL at growing row counts, run by the CLI.

Per phase and size: its time, rows/s, CPU and the peak RSS of every process kind, and the ratios issue 47 tracks.

    .venv/bin/python bench/data_scale_bench.py                      # synthetic 1M, 4M, 16M; clicks 250k, 2M, 8M
    .venv/bin/python bench/data_scale_bench.py --big                # + synthetic 32M (16 GB of raw + shards on disk)
    .venv/bin/python bench/data_scale_bench.py --synthetic-rows 1M,4M --clicks-rows 250k [--markdown]
        [--clicks-vocab 10000000] [--workdir DIR] [--keep] [--interval 0.5] [--json FILE] [--set KEY=VALUE ...]

Pipelines (each size in a fresh workdir of its own, a temp folder under --workdir, removed after unless --keep):

  synthetic  conf/synthetic.yaml, data.synthetic.rows=R; pinned here as well, so a later edit of the
             config does not silently change the bench: 64 float32 features, 10 classes, the small MLP
             (model.kind=mlp, model.hidden=[128]), train.epochs=1, parallelism.data=2 (ps.mode=sync,
             train.batch_size=256 per worker, spark.master=local[2], driver memory 4g from conf/base.yaml).
             Phases: generate (`shardline generate`: lands the raw Parquet), etl (`shardline etl`: reuses
             the landed source, whose spec is unchanged), train (`shardline train`), evaluate
             (`shardline evaluate`: the test split in Spark).
  clicks     conf/clicks.yaml, data.clicks.rows=R, data.clicks.vocab=--clicks-vocab (10M), 2 shards.
             Phases: generate (the CLI has no subcommand that only lands the click log: a Python process
             that does what `shardline etl` does first, pipeline.etl.clicks.generate_clicks on the same
             config, in its own session) and etl (`shardline etl`, which then reuses that landed log).

tracking.log_model=false in both: the served MLflow model that `shardline train` would also log is a
cost that does not grow with the data (and it reads raw rows back for its input example).

Every phase runs as its own command, a fresh process with its own local[2] session: nothing is warm. A
thread (bench/_proc_sampler.py) reads /proc/<pid>/status (VmRSS) and /proc/<pid>/stat (CPU ticks) of
the command's whole process tree every --interval s (0.5) and classifies each process by its cmdline:

  driver   the command's own Python process (the Spark driver's Python side; the parameter server of
           `train` runs in it, ps.placement=driver);
  JVM      the Spark JVM, a child of the driver Python (pyspark starts it with spark-submit, which execs
           java). With local[N] it is the driver AND the executor: one JVM, so there is no separate
           executor JVM to report; with a cluster master, executor JVMs (CoarseGrainedExecutorBackend)
           on this host get a column of their own;
  worker   Spark's Python workers: pyspark.daemon (a child of the JVM) and the workers it forks (the
           UDFs, the barrier training tasks, the evaluation). "max worker" is the largest single one;
           "workers" their sum at one sample (forked workers share the daemon's pages, which VmRSS
           counts in each, so the sum overstates their memory);
  other    anything else (spark-submit's short-lived launcher JVM, ...), in the tree column only.

Peaks are the largest sampled values; "tree" is the largest sum over all processes at one sample. The
kernel's own high-water mark (VmHWM) of each process is kept in --json for comparison (a spike shorter
than the interval can pass between two samples).

Phase time ("s"): the step's own clock as the pipeline logs it ("generated ... in X s", "etl done in
X s", "training done: ... in X s", "evaluation on test (..., X s)"): after the process and its Spark
session are up; "wall s" is the whole command (Python + JVM start, session, MLflow). The ETL logs its
profile pass ("profile pass: ... in X s", clicks: "profile + fit: ... in X s", both counted from the
ETL's start) and its end, so it is split into etl: profile (reading the source, profiling; clicks:
also fitting the vocabularies) and etl: write (packing and writing the shards + manifest), each with
the RSS peaks of its own time window. Rows per phase: generate and etl the rows landed; train the train
split's rows x epochs (samples); evaluate the test split's rows. CPU s: all processes of the tree in
the same window as s, sampled (a process's CPU after its last sample is missed). The RSS peaks of a
phase are over its whole command (etl: profile / write: over their own windows).

Ratios printed after the table (the figures the targets of issue 47 need; bench/_scale_tables.py):
peak RSS of every process kind at each synthetic size / at the smallest (target <= 1.2 at the
largest); the click ETL's driver peak RSS at each size / the smallest (target <= 1.2); time per row of
each phase at each synthetic size / at the size before it (target <= 1.1 for 16M / 4M).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc_sampler import Line, TreeSampler, read_proc, run_sampled  # noqa: E402
from _scale_tables import PhaseResult, label, progress_line, ratio_rows, report  # noqa: E402

SYNTHETIC_CONF = REPO / "conf" / "synthetic.yaml"
CLICKS_CONF = REPO / "conf" / "clicks.yaml"
SYNTHETIC_ROWS = "1M,4M,16M"
BIG_ROWS = "32M"
CLICKS_ROWS = "250k,2M,8M"
CLICKS_VOCAB = 10_000_000

# The synthetic pipeline as issue 47 measures it (conf/synthetic.yaml's values, pinned).
SYNTHETIC_PINNED = ["data.synthetic.features=64", "data.synthetic.classes=10", "model.kind=mlp", "model.hidden=[128]",
                    "train.epochs=1", "parallelism.data=2", "tracking.log_model=false"]
CLICKS_PINNED = ["parallelism.data=2", "tracking.log_model=false"]

# The clicks "generate" phase: what `shardline etl` does first (read_source -> generate_clicks), alone.
LAND_CLICKS = """\
import sys
from pipeline.cli import configure_logging
from pipeline.config import load
from pipeline.etl.clicks import generate_clicks
from pipeline.session import get_or_create_spark
configure_logging("INFO")
cfg = load(sys.argv[1], sys.argv[2:])
spark = get_or_create_spark(cfg.spark)
print(f"click log: {generate_clicks(spark, cfg.data, cfg.workdir, force=True)}")
"""


# -- sizes -------------------------------------------------------------------------------------------
def parse_rows(text: str) -> int:
    """'250k' -> 250000, '1.5M' -> 1500000, '2G' -> 2e9, '20000' / '1e6' as they are."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(t[-1:].lower(), 1)
    number = float(t[:-1] if scale > 1 else t)
    rows = int(round(number * scale))
    if rows < 1:
        raise ValueError(f"a row count must be >= 1: {text!r}")
    return rows


def parse_sizes(text: str) -> list[int]:
    """'1M,4M,16M' -> sorted distinct row counts; '' or 'none' -> none."""
    if text.strip().lower() in ("", "none", "0"):
        return []
    return sorted({parse_rows(part) for part in text.split(",") if part.strip()})


# -- one phase: its log lines and its samples --------------------------------------------------------
# What each phase logs (pipeline/etl/synthetic.py, clicks.py, run.py, typed.py, launch/train.py,
# evaluate/spark_eval.py): (name, regex); the seconds group is "s", a row count "rows".
PATTERNS = {
    "generate": re.compile(r"generated (?P<rows>\d+) (?:synthetic|click) rows .* in (?P<s>[\d.]+)s\b"),
    "profile": re.compile(r"(?:profile pass: (?P<rows>\d+) rows|profile \+ fit: (?P<rows2>\d+) rows, \d+ features)"
                          r" in (?P<s>[\d.]+)s"),
    "etl": re.compile(r"etl done in (?P<s>[\d.]+)s: (?P<rows>\d+) input rows"),
    "train": re.compile(r"training done: (?P<steps>\d+) steps in (?P<s>[\d.]+)s"),
    "evaluate": re.compile(r"evaluation on test \((?P<rows>\d+) rows, (?P<s>[\d.]+)s\)"),
    "session": re.compile(r"spark session: master="),
    "splits": re.compile(r"^rows: (?P<splits>.*)$"),
}


def find(lines: list[Line], name: str) -> tuple[Optional[Line], Optional[re.Match]]:
    """The last line matching PATTERNS[name] and its match."""
    pattern = PATTERNS[name]
    for line in reversed(lines):
        m = pattern.search(line.text)
        if m:
            return line, m
    return None, None


def phase_results(pipeline: str, rows: int, phase: str, counted: int, rc: int, wall: float, start: float,
                  end: float, lines: list[Line], sampler: TreeSampler) -> list[PhaseResult]:
    """The phase's row (and for etl its profile / write rows) from its log lines and samples."""
    if rc != 0:
        tail = "\n".join(line.text for line in lines[-40:])
        return [PhaseResult(pipeline, rows, phase, counted, 0.0, wall, 0.0, sampler.peaks(), "command",
                            sampler.hwm(), f"exit {rc}:\n{tail}")]
    done, m = find(lines, phase)
    if done is not None:
        seconds, timed_by, step_start, step_end = float(m.group("s")), "log", done.t - float(m.group("s")), done.t
    else:  # the log line moved or changed: the command from its Spark session up
        session, _ = find(lines, "session")
        step_start = session.t if session else start
        seconds, timed_by, step_end = end - step_start, "command", end
    out = [PhaseResult(pipeline, rows, phase, counted, seconds, wall, sampler.cpu_between(step_start, step_end),
                       sampler.peaks(), timed_by, sampler.hwm())]
    if phase == "etl" and done is not None:
        prof, pm = find(lines, "profile")
        if prof is not None:
            split_t = prof.t
            profile_s = float(pm.group("s"))
            out.append(PhaseResult(pipeline, rows, "etl: profile", counted, profile_s, wall,
                                   sampler.cpu_between(step_start, split_t), sampler.peaks(step_start, split_t)))
            out.append(PhaseResult(pipeline, rows, "etl: write", counted, max(seconds - profile_s, 0.0), wall,
                                   sampler.cpu_between(split_t, step_end), sampler.peaks(split_t, step_end)))
    return out


# -- the pipelines -----------------------------------------------------------------------------------
def shardline_cmd() -> list[str]:
    """The shardline CLI of this interpreter's venv (`python -m pipeline.cli` where it has no script)."""
    script = Path(sys.executable).with_name("shardline")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipeline.cli"]


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def overrides_for(pipeline: str, rows: int, workdir: str, clicks_vocab: int, extra: list[str]) -> list[str]:
    if pipeline == "synthetic":
        return [f"workdir={workdir}", f"data.synthetic.rows={rows}", *SYNTHETIC_PINNED, *extra]
    return [f"workdir={workdir}", f"data.clicks.rows={rows}", f"data.clicks.vocab={clicks_vocab}", *CLICKS_PINNED,
            *extra]


def phase_commands(pipeline: str, overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(phase, argv) in order."""
    if pipeline == "synthetic":
        conf = str(SYNTHETIC_CONF)
        return [(phase, [*shardline_cmd(), phase, "--config", conf, *overrides])
                for phase in ("generate", "etl", "train", "evaluate")]
    conf = str(CLICKS_CONF)
    return [("generate", [sys.executable, "-c", LAND_CLICKS, conf, *overrides]),
            ("etl", [*shardline_cmd(), "etl", "--config", conf, *overrides])]


def run_size(pipeline: str, rows: int, args, progress=print) -> list[PhaseResult]:
    """Every phase of ``pipeline`` at ``rows`` in a fresh workdir (removed after unless --keep)."""
    parent = args.workdir
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"shardline-scale-{pipeline}-{label(rows)}-", dir=parent))
    overrides = overrides_for(pipeline, rows, str(folder / "work"), args.clicks_vocab, list(args.set))
    results: list[PhaseResult] = []
    splits: dict[str, int] = {}
    epochs = 1
    try:
        from pipeline.config import load

        cfg = load(str(SYNTHETIC_CONF if pipeline == "synthetic" else CLICKS_CONF), overrides)
        epochs = cfg.train.epochs
        for phase, cmd in phase_commands(pipeline, overrides):
            counted = {"train": splits.get("train", 0) * epochs, "evaluate": splits.get("test", 0)}.get(phase, rows)
            rc, wall, start, end, lines, sampler = run_sampled(cmd, str(folder), child_env(), args.interval,
                                                               folder / f"{phase}.log", args.timeout)
            if phase == "etl":
                _, m = find(lines, "splits")
                if m:
                    splits = {k: int(v) for k, v in (p.split("=") for p in m.group("splits").split(", "))}
            if phase == "evaluate":
                _, m = find(lines, "evaluate")
                counted = int(m.group("rows")) if m else counted
            got = phase_results(pipeline, rows, phase, counted, rc, wall, start, end, lines, sampler)
            results.extend(got)
            got[0].tree = sampler.tree()
            for r in got:
                progress(progress_line(r))
            if got[0].error:
                break
    finally:
        if args.keep:
            progress(f"  kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return results


# -- main --------------------------------------------------------------------------------------------
def describe(args) -> str:
    """One paragraph: the machine, the configs, the sampling."""
    from pipeline.config import load

    parts = []
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    mem = re.search(r"MemTotal:\s+(\d+)", read_proc("/proc/meminfo") or "")
    memory = f", {int(mem.group(1)) / 2**20:.0f} GiB" if mem else ""
    parts.append(f"{time.strftime('%Y-%m-%d')}, commit {commit or '?'}, {os.cpu_count()} CPUs{memory}")
    if args.synthetic_sizes:
        cfg = load(str(SYNTHETIC_CONF), overrides_for("synthetic", 1, "/tmp/x", args.clicks_vocab, list(args.set)))
        s = cfg.data.synthetic
        parts.append(f"synthetic: {s.features} float32 features, {s.classes} classes, {cfg.model.kind} hidden "
                     f"{cfg.model.hidden}, {cfg.train.epochs} epoch(s), {cfg.parallelism.data} workers, "
                     f"ps {cfg.ps.mode}, batch {cfg.train.batch_size}/worker")
    if args.clicks_sizes:
        cfg = load(str(CLICKS_CONF), overrides_for("clicks", 1, "/tmp/x", args.clicks_vocab, list(args.set)))
        c = cfg.data.clicks
        parts.append(f"clicks: {c.numeric} numeric + {c.categorical} categorical, vocab {c.vocab:,} "
                     f"(c0 {c.big_vocab:,}), {cfg.parallelism.data} shards")
    spark = cfg.spark
    parts.append(f"spark.master={spark.master} (local: one JVM is the driver and the executor), driver memory "
                 f"{spark.conf.get('spark.driver.memory', '?')}; each phase its own command, a fresh process; "
                 f"RSS (VmRSS) and CPU of its process tree sampled every {args.interval:g}s; "
                 f"tracking.log_model=false" + (f"; --set {' '.join(args.set)}" if args.set else ""))
    return "; ".join(parts)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic-rows", default=SYNTHETIC_ROWS,
                        help=f"synthetic sizes, comma-separated, k/M suffixes (default {SYNTHETIC_ROWS}; none: skip)")
    parser.add_argument("--big", action="store_true", help=f"add synthetic {BIG_ROWS} (needs ~16 GB of disk)")
    parser.add_argument("--clicks-rows", default=CLICKS_ROWS,
                        help=f"click ETL sizes (default {CLICKS_ROWS}; none: skip)")
    parser.add_argument("--clicks-vocab", type=parse_rows, default=CLICKS_VOCAB,
                        help=f"data.clicks.vocab: distinct ids of c1..c25 (default {CLICKS_VOCAB:,})")
    parser.add_argument("--workdir", default=None,
                        help="parent folder of each size's fresh workdir (default: the system temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep each size's workdir (data, shards, logs)")
    parser.add_argument("--interval", type=float, default=0.5, help="RSS sampling interval, s (default 0.5)")
    parser.add_argument("--timeout", type=float, default=None, help="give up on a phase after this many s")
    parser.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    parser.add_argument("--json", default=None, help="write every figure (and each phase's process tree) here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra config override for both pipelines (repeatable)")
    args = parser.parse_args(argv)
    try:
        args.synthetic_sizes = parse_sizes(args.synthetic_rows)
        if args.big:
            args.synthetic_sizes = sorted(set(args.synthetic_sizes) | set(parse_sizes(BIG_ROWS)))
        args.clicks_sizes = parse_sizes(args.clicks_rows)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.synthetic_sizes and not args.clicks_sizes:
        parser.error("nothing to run: give --synthetic-rows and/or --clicks-rows")
    return args


def run(args, progress=None) -> list[PhaseResult]:
    """Every size of both pipelines, smallest first; the phase rows in order."""
    progress = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    results: list[PhaseResult] = []
    for pipeline, sizes in (("synthetic", args.synthetic_sizes), ("clicks", args.clicks_sizes)):
        for rows in sizes:
            results.extend(run_size(pipeline, rows, args, progress))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    description = describe(args)  # loads both configs with every override: a bad --set fails here, not later
    started = time.monotonic()
    results = run(args)
    report(results, description, args.markdown)
    print(f"\ntotal runtime: {time.monotonic() - started:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items()},
             "results": [{**asdict(r), "rate": r.rate} for r in results],
             "ratios": ratio_rows(results)}, indent=1, default=str))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
