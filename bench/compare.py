"""Old commit vs new tree, side by side in one run: every figure a bench prints, with its run-to-run noise.

    .venv/bin/python bench/compare.py --old 016be04 [--new COMMIT] [--bench ps_bench e2e_bench] [--repeats 3]
        [--args 'ps_bench=--sizes-mb 1 4 ...'] [--logdir DIR] [-- <args appended for every bench>]

The full compare (issue 14; both benches, 3 rounds, the default bench arguments below), on a quiet machine:

    .venv/bin/python bench/compare.py --old 016be04 --bench ps_bench e2e_bench --repeats 3

Default bench arguments (sized so that this full compare stays under ~10 minutes on a 2-core box;
`--args NAME=...` replaces them for one bench, arguments after `--` are appended for every bench):

    ps_bench   --sizes-mb 1 4 --steps 20 --warmup 3 --workers 8 32 --shards 1 2 --window-s 2
    e2e_bench  --rows 100000 --epochs 1

The OLD side is `git archive <old>` unpacked into a temp dir outside the repo; the NEW side is this working
tree (or `--new <commit>`, unpacked the same way). Each side runs *its own* copy of the bench script with
cwd and PYTHONPATH = <its tree>, so `import pipeline` resolves to that tree in the driver, in its spawned
processes and in Spark's Python workers (which do not see the script's own sys.path insert: started from
another directory without PYTHONPATH they import the venv's editable install, i.e. /work/main, for the OLD
side too; the finder of that install comes after PYTHONPATH on sys.meta_path). A small wrapper runs
the script and prints `pipeline.__file__` from the driver and, for Spark benches, from the Python workers
(a job run inside SparkSession.stop(), after every figure is measured); a run that imported the other
tree aborts the compare. e2e_bench gets a fresh --workdir per run (generate/ETL skip existing data).

Rounds alternate: per round and bench, old then new. Per figure the table shows the median of each side,
new/old, and each side's noise = (max - min) / median over its repeats. A figure is flagged WORSE only
when new is worse than old by more than the larger of the two noises (lower-is-better figures:
new/old > 1 + noise; higher-is-better: new/old < 1 - noise). With --repeats 1 there is no noise estimate
("worse?" = worse at all). Figures marked "ref" involve no shardline code (gloo, raw TCP): a flag there
means the machine was noisier than the repeats showed. "info" figures (total runtimes, TorchDistributor's
phase timeline) are shown, never flagged. To see the noise floor itself, run old against old
(`--new` = `--old`): on a 2-core box shared with test runs, identical code differed by up to 6x per figure
(1 MB sync rounds, 2-shard async), so run on a quiet machine with --repeats >= 3. Raw logs of every run and a JSON summary land in --logdir.
Exit status: 1 if a run failed, an import check failed, or a figure is WORSE; else 0.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DEFAULT_ARGS = {
    "ps_bench": "--sizes-mb 1 4 --steps 20 --warmup 3 --workers 8 32 --shards 1 2 --window-s 2",
    "e2e_bench": "--rows 100000 --epochs 1",
}
SPARK_BENCHES = {"e2e_bench"}
WORKDIR_BENCHES = {"e2e_bench"}  # get a fresh --workdir per run

LOWER, HIGHER = "lower", "higher"


@dataclass
class Figure:
    name: str
    value: float | None  # None: the run printed something that is not a number ("n/a", "error")
    better: str  # LOWER | HIGHER
    kind: str = ""  # "" (shardline code, flagged) | "ref" (no shardline code) | "info" (never flagged)
    raw: str = ""


# -- parsing --------------------------------------------------------------------------------------------
_NUM = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?$", re.I)


def _number(cell: str) -> float | None:
    """'12,345' -> 12345.0, '1.85x' -> 1.85, '0.4s' -> 0.4; None for 'n/a', 'error', '-', text."""
    text = cell.strip()
    for suffix in ("x", "s"):
        if text.endswith(suffix) and len(text) > 1 and text[-2].isdigit():
            text = text[:-1]
    if not _NUM.match(text):
        return None
    return float(text.replace(",", ""))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("|")]


def _tables(text: str, first_cell: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every '|' table whose header's first cell is `first_cell`: (header cells, data rows) up to a blank line;
    separator rows (----|----) are skipped, rows with another cell count end the table."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "|" not in line or _cells(line)[0] != first_cell:
            continue
        header = _cells(line)
        rows = []
        for row in lines[i + 1:]:
            if not row.strip() or "|" not in row:
                break
            if set(row.replace("|", "").strip()) <= {"-"}:
                continue
            cells = _cells(row)
            if len(cells) != len(header):
                break
            rows.append(cells)
        found.append((header, rows))
    return found


def parse_ps_bench(text: str) -> list[Figure]:
    """The figures of bench/ps_bench.py's stdout: the sync-round table (ms per step and the a/b, a/c ratios
    per size), the async updates/s table (per workers x shards, and '2 vs 1') and the total runtime."""
    figures: list[Figure] = []
    for header, rows in _tables(text, "size"):
        for cells in rows:
            size = cells[0]
            for col, cell in zip(header[1:], cells[1:]):
                kind = "ref" if col.startswith(("(b)", "(c)")) else ""
                name = f"sync {size}: {col}" + ("" if "/" in col else " ms")
                figures.append(Figure(name, _number(cell), LOWER, kind, cell))
    for header, rows in _tables(text, "workers"):
        for cells in rows:
            workers = cells[0]
            for col, cell in zip(header[1:], cells[1:]):
                if col == "2 vs 1":
                    figures.append(Figure(f"async {workers} workers: 2 vs 1 shard(s)", _number(cell), HIGHER,
                                          raw=cell))
                else:
                    figures.append(Figure(f"async {workers} workers: {col} updates/s", _number(cell), HIGHER,
                                          raw=cell))
    m = re.search(r"^total ([\d.]+)s\s*$", text, re.M)
    if m:
        figures.append(Figure("total runtime s", float(m.group(1)), LOWER, "info", m.group(0)))
    return figures


_TD_RATIO = re.compile(r"^(.+?) / TorchDistributor: samples/s ([\d.]+)x, wall time ([\d.]+)x\s*$", re.M)
_LOOP_NOTE = re.compile(r"^\s+(.+?): (\d+) steps; slowest worker run\(\) ([\d.]+)s of ([\d.]+)s wall "
                        r"\(PS/driver setup, barrier stage launch, teardown: ([-\d.]+)s\)", re.M)
_TD_NOTE = re.compile(r"^\s+TorchDistributor: ([\d.]+)s wall.*?timeline: (.*)$", re.M)
_PHASE = re.compile(r"^([-\d.]+)s (.+)$")


def parse_e2e_bench(text: str) -> list[Figure]:
    """The figures of bench/e2e_bench.py's stdout: per backend wall s, train samples/s and test acc; the
    shardline / TorchDistributor ratios; shardline's loop vs setup split; the untimed prep; TorchDistributor's
    rank 0 timeline and the total runtime (info)."""
    figures: list[Figure] = []
    m = re.search(r"generate \+ ETL \+ warm-up ([\d.]+)s", text)
    if m:
        figures.append(Figure("generate + ETL + warm-up s (untimed prep)", float(m.group(1)), LOWER, raw=m.group(0)))
    columns = {"wall s": LOWER, "train samples/s": HIGHER, "test acc": HIGHER}
    for header, rows in _tables(text, "backend"):
        for cells in rows:
            for col, cell in zip(header[1:], cells[1:]):
                figures.append(Figure(f"{cells[0]}: {col}", _number(cell), columns.get(col, LOWER), raw=cell))
    for m in _TD_RATIO.finditer(text):
        figures.append(Figure(f"{m.group(1)} / TorchDistributor: samples/s x", float(m.group(2)), HIGHER,
                              raw=m.group(0)))
        figures.append(Figure(f"{m.group(1)} / TorchDistributor: wall time x", float(m.group(3)), LOWER,
                              raw=m.group(0)))
    for m in _LOOP_NOTE.finditer(text):
        figures.append(Figure(f"{m.group(1)}: slowest worker run() s", float(m.group(3)), LOWER, raw=m.group(0)))
        figures.append(Figure(f"{m.group(1)}: PS/driver setup + launch + teardown s", float(m.group(5)), LOWER,
                              raw=m.group(0)))
    for m in _TD_NOTE.finditer(text):
        for part in m.group(2).split("; "):
            p = _PHASE.match(part.strip())
            if p:
                figures.append(Figure(f"TorchDistributor rank 0: {p.group(2)} s", float(p.group(1)), LOWER, "info",
                                      part))
    m = re.search(r"^total runtime: ([\d.]+)s\s*$", text, re.M)
    if m:
        figures.append(Figure("total runtime s", float(m.group(1)), LOWER, "info", m.group(0)))
    return figures


PARSERS = {"ps_bench": parse_ps_bench, "e2e_bench": parse_e2e_bench}


# -- summary --------------------------------------------------------------------------------------------
def noise(values: list[float]) -> float | None:
    """Run-to-run spread of one side: (max - min) / median; None with fewer than 2 values (or median 0)."""
    if len(values) < 2:
        return None
    med = statistics.median(values)
    return (max(values) - min(values)) / abs(med) if med else None


@dataclass
class Row:
    name: str
    better: str
    kind: str
    old: list[float] = field(default_factory=list)
    new: list[float] = field(default_factory=list)
    old_raw: list[str] = field(default_factory=list)  # non-numeric cells ("n/a ...", "error")
    new_raw: list[str] = field(default_factory=list)
    old_med: float | None = None
    new_med: float | None = None
    ratio: float | None = None
    old_noise: float | None = None
    new_noise: float | None = None
    verdict: str = ""


def verdict(better: str, kind: str, ratio: float | None, old_noise: float | None, new_noise: float | None) -> str:
    """'WORSE' / 'better' / '~' (within noise); 'worse?'/'better?' without a noise estimate; 'ref worse' for
    figures without shardline code; '' when there is nothing to compare or for info figures."""
    if ratio is None or kind == "info":
        return ""
    noises = [n for n in (old_noise, new_noise) if n is not None]
    band = max(noises) if noises else 0.0
    worse = ratio > 1 + band if better == LOWER else ratio < 1 - band
    improved = ratio < 1 - band if better == LOWER else ratio > 1 + band
    word = "WORSE" if worse else "better" if improved else "~"
    if word == "~":
        return word
    if not noises:
        word = word.lower() + "?"
    return f"ref {word.lower()}" if kind == "ref" else word


def summarize(old_runs: list[list[Figure]], new_runs: list[list[Figure]]) -> list[Row]:
    """One row per figure name (first-seen order), medians, new/old, per-side noise and the verdict."""
    rows: dict[str, Row] = {}
    for side, runs in (("old", old_runs), ("new", new_runs)):
        for figures in runs:
            for f in figures:
                row = rows.setdefault(f.name, Row(f.name, f.better, f.kind))
                if f.value is None:
                    getattr(row, f"{side}_raw").append(f.raw)
                else:
                    getattr(row, side).append(f.value)
    for row in rows.values():
        row.old_med = statistics.median(row.old) if row.old else None
        row.new_med = statistics.median(row.new) if row.new else None
        if row.old_med and row.new_med is not None:
            row.ratio = row.new_med / row.old_med
        row.old_noise, row.new_noise = noise(row.old), noise(row.new)
        row.verdict = verdict(row.better, row.kind, row.ratio, row.old_noise, row.new_noise)
    return list(rows.values())


def _fmt_value(med: float | None, raw: list[str], n: int, runs: int) -> str:
    if med is None:
        return (raw[0][:18] if raw else "-")
    text = f"{med:,.0f}" if abs(med) >= 1000 else f"{med:.4g}"
    return text + (f" ({n}/{runs})" if n != runs else "")


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def format_table(rows: list[Row], runs_old: int, runs_new: int, title: str = "") -> str:
    """The comparison table; a value from fewer runs than the side had shows '(n/runs)'."""
    head = ["figure", "better", "old (median)", "new (median)", "new/old", "noise old", "noise new", "verdict"]
    body = []
    for r in rows:
        name = r.name + (" [ref]" if r.kind == "ref" else " [info]" if r.kind == "info" else "")
        body.append([name, r.better,
                     _fmt_value(r.old_med, r.old_raw, len(r.old), runs_old),
                     _fmt_value(r.new_med, r.new_raw, len(r.new), runs_new),
                     "-" if r.ratio is None else f"{r.ratio:.3f}",
                     _fmt_pct(r.old_noise), _fmt_pct(r.new_noise), r.verdict])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = [title] if title else []
    for i, cells in enumerate([head] + body):
        lines.append(" | ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths))))
        if i == 0:
            lines.append("-|-".join("-" * w for w in widths))
    return "\n".join(lines)


# -- import check ---------------------------------------------------------------------------------------
# Runs the bench script as __main__ (its own sys.path insert included) and reports which `pipeline` the driver
# imported; with --spark, also what Spark's Python workers import (a job inside SparkSession.stop(), i.e.
# after the bench measured everything). Markers go to stdout, prefixed "compare: ".
WRAPPER = r"""
import json, os, runpy, sys
spark_check = sys.argv[1] == "--spark"
script = sys.argv[2]
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` would have it
if spark_check:
    from pyspark.sql import SparkSession
    _stop = SparkSession.stop
    def _where(_):
        import importlib, os
        out = {}
        for name in ("pipeline", "udfs"):
            try:
                out[name] = importlib.import_module(name).__file__
            except Exception as exc:
                out[name] = "import failed: %r" % (exc,)
        yield (os.getpid(), out)
    def _checked_stop(self):
        try:
            got = self.sparkContext.parallelize(range(2), 2).mapPartitions(_where).collect()
            print("compare: executor pipeline=" + json.dumps(sorted({o["pipeline"] for _, o in got})), flush=True)
            print("compare: executor udfs=" + json.dumps(sorted({o["udfs"] for _, o in got})), flush=True)
        except Exception as exc:
            print("compare: executor check failed: %r" % (exc,), flush=True)
        _stop(self)
    SparkSession.stop = _checked_stop
try:
    runpy.run_path(script, run_name="__main__")
finally:
    mod = sys.modules.get("pipeline")
    print("compare: driver pipeline=" + json.dumps(getattr(mod, "__file__", None)), flush=True)
"""


def import_check(stdout: str, tree: Path, spark: bool) -> list[str]:
    """Problems with the run's import markers: the driver's (and, for Spark benches, the Python workers')
    `pipeline` must come from `tree`."""
    problems = []
    root = str(tree.resolve()) + os.sep
    markers = dict(re.findall(r"^compare: (driver pipeline|executor pipeline|executor udfs)=(.*)$", stdout, re.M))
    wanted = ["driver pipeline"] + (["executor pipeline", "executor udfs"] if spark else [])
    for key in wanted:
        if key not in markers:
            failed = re.search(r"^compare: executor check failed: (.*)$", stdout, re.M)
            problems.append(f"no '{key}' marker" + (f" ({failed.group(1)})" if failed and "executor" in key else ""))
            continue
        got = json.loads(markers[key])
        paths = got if isinstance(got, list) else [got]
        bad = [p for p in paths if not (isinstance(p, str) and os.path.realpath(p).startswith(root))]
        if bad or not paths:
            problems.append(f"{key} from {bad or paths}, not from {tree}")
    return problems


# -- running --------------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def unpack(commit: str, into: Path) -> str:
    """`git archive` of a commit into a directory (no worktree, nothing written to .git); its full sha."""
    sha = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", sha], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return sha


def side_env(tree: Path) -> dict[str, str]:
    python = os.path.abspath(sys.executable)  # the venv's python, not resolved past its symlink
    env = {**os.environ, "PYTHONPATH": str(tree), "PYSPARK_PYTHON": python, "PYSPARK_DRIVER_PYTHON": python}
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return env


def run_one(tree: Path, bench: str, args: list[str], log: Path, timeout_s: float) -> tuple[int, str, float]:
    """Runs tree/bench/<bench>.py through WRAPPER, cwd = tree; (returncode, stdout, seconds). stdout+stderr
    go to `log`; the whole process group is killed on timeout or Ctrl-C."""
    script = tree / "bench" / f"{bench}.py"
    cmd = [sys.executable, "-c", WRAPPER, "--spark" if bench in SPARK_BENCHES else "--no-spark", str(script), *args]
    started = time.perf_counter()
    with open(log, "w") as err:
        err.write(f"$ cd {tree} && PYTHONPATH={tree} {shlex.join([sys.executable, str(script), *args])}\n")
        err.flush()
        proc = subprocess.Popen(cmd, cwd=tree, env=side_env(tree), stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except BaseException as exc:  # TimeoutExpired, KeyboardInterrupt: end the bench's whole process group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, _ = proc.communicate()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            stdout += f"\ncompare: timed out after {timeout_s:g}s\n"
            proc.returncode = 124
        err.write("\n---- stdout ----\n" + stdout)
    return proc.returncode, stdout, time.perf_counter() - started


def preflight(tree: Path) -> str:
    """`import pipeline` in the side's environment (a broken tree fails here, not after a round)."""
    out = subprocess.run([sys.executable, "-c", "import pipeline; print(pipeline.__file__)"], cwd=tree,
                         env=side_env(tree), capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"`import pipeline` fails in {tree}:\n{out.stderr[-3000:]}")
    return out.stdout.strip()


def first_error(log_text: str) -> str:
    """': <the first distinct exception line>' of a failed run's log, or ''."""
    m = re.search(r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt|Exit)\b:? .*$", log_text, re.M)
    return f": {m.group(0)[:240]}" if m else ""


def bench_args(benches: list[str], overrides: list[str], extra: list[str]) -> dict[str, list[str]]:
    given = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in PARSERS:
            raise SystemExit(f"--args wants NAME=ARGS with NAME one of {sorted(PARSERS)}: {item!r}")
        given[name] = value
    return {b: shlex.split(given.get(b, DEFAULT_ARGS[b])) + extra for b in benches}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="commit whose bench scripts + pipeline are the OLD side")
    parser.add_argument("--new", default=None, help="commit for the NEW side (default: this working tree)")
    parser.add_argument("--bench", nargs="+", choices=sorted(PARSERS), default=["ps_bench", "e2e_bench"])
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs old then new per bench")
    parser.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                        help="replace a bench's default arguments, e.g. --args 'ps_bench=--sizes-mb 4'")
    parser.add_argument("--timeout-s", type=float, default=1200, help="per bench run")
    parser.add_argument("--logdir", default=None, help="raw logs + summary.json (default: a new /tmp dir, kept)")
    opts = parser.parse_args(argv)
    if opts.repeats < 1:
        parser.error("--repeats must be >= 1")
    args = bench_args(opts.bench, opts.args, extra)
    logdir = Path(opts.logdir or tempfile.mkdtemp(prefix="shardline-compare-logs-"))
    logdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="shardline-compare-"))
    status = 0
    try:
        old_tree = scratch / "old"
        old_sha = unpack(opts.old, old_tree)
        if opts.new:
            new_tree = scratch / "new"
            new_sha = unpack(opts.new, new_tree)
            new_label = f"{opts.new} ({new_sha[:10]})"
        else:
            new_tree = REPO
            dirty = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
            new_label = f"working tree {REPO} (HEAD {_git('rev-parse', '--short=10', 'HEAD')}" + \
                        (", with uncommitted changes)" if dirty else ")")
        sides = {"old": old_tree, "new": new_tree}
        print(f"old: {opts.old} ({old_sha[:10]}) unpacked in {old_tree}")
        print(f"new: {new_label}")
        for side, tree in sides.items():
            print(f"{side}: preflight import -> {preflight(tree)}")
        for b in opts.bench:
            fresh = "  (+ a fresh --workdir per run)" if b in WORKDIR_BENCHES else ""
            print(f"{b} args: {shlex.join(args[b])}{fresh}")
        print(f"logs: {logdir}\n", flush=True)

        runs: dict[str, dict[str, list[list[Figure]]]] = {b: {"old": [], "new": []} for b in opts.bench}
        failures: list[str] = []
        walls: dict[str, dict[str, list[float]]] = {b: {"old": [], "new": []} for b in opts.bench}
        started = time.perf_counter()
        for round_ in range(1, opts.repeats + 1):
            for b in opts.bench:
                for side, tree in sides.items():
                    run_args = list(args[b])
                    workdir = None
                    if b in WORKDIR_BENCHES and "--workdir" not in run_args:
                        workdir = scratch / f"{b}-{side}-{round_}"
                        run_args += ["--workdir", str(workdir)]
                    log = logdir / f"{b}-{side}-{round_}.log"
                    rc, stdout, secs = run_one(tree, b, run_args, log, opts.timeout_s)
                    if workdir is not None:
                        shutil.rmtree(workdir, ignore_errors=True)
                    problems = import_check(stdout, tree, b in SPARK_BENCHES)
                    driver = re.search(r"^compare: driver pipeline=(.*)$", stdout, re.M)
                    executors = re.search(r"^compare: executor pipeline=(.*)$", stdout, re.M)
                    workers = ""
                    if b in SPARK_BENCHES:
                        workers = f", Spark workers {executors.group(1) if executors else '?'}"
                    print(f"round {round_} {b} {side}: rc {rc}, {secs:.0f}s; pipeline from driver "
                          f"{driver.group(1) if driver else '?'}{workers}", flush=True)
                    if problems:
                        raise RuntimeError(f"{b} {side} round {round_}: import check failed: {'; '.join(problems)} "
                                           f"(log {log})")
                    walls[b][side].append(secs)
                    if rc != 0:
                        failures.append(f"{b} {side} round {round_}: rc {rc}{first_error(log.read_text())} (log {log})")
                    figures = PARSERS[b](stdout)
                    if not figures and rc == 0:
                        failures.append(f"{b} {side} round {round_}: no figures parsed (log {log})")
                    runs[b][side].append(figures)
        total = time.perf_counter() - started

        summary = {"old": old_sha, "new": new_label, "repeats": opts.repeats, "args": args, "benches": {}}
        for b in opts.bench:
            rows = summarize(runs[b]["old"], runs[b]["new"])
            print()
            print(format_table(rows, len(runs[b]["old"]), len(runs[b]["new"]),
                               f"== {b} ({opts.repeats} round(s); run wall s old "
                               f"{[round(s) for s in walls[b]['old']]}, new {[round(s) for s in walls[b]['new']]})"))
            worse = [r.name for r in rows if r.verdict == "WORSE"]
            if worse:
                status = 1
            summary["benches"][b] = [r.__dict__ for r in rows]
        print(f"\ncompare: {total:.0f}s for {opts.repeats} round(s) of {', '.join(opts.bench)}")
        if opts.repeats < 2:
            print("note: 1 round gives no noise estimate; '?' verdicts compare medians of single runs")
        all_worse = [f"{b}: {r['name']}" for b, rows in summary["benches"].items() for r in rows
                     if r["verdict"] == "WORSE"]
        print("worse beyond noise: " + ("; ".join(all_worse) if all_worse else "none"))
        for f in failures:
            print(f"FAILED: {f}")
        if failures:
            status = 1
        summary["failures"] = failures
        (logdir / "summary.json").write_text(json.dumps(summary, indent=1))
        return status
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
