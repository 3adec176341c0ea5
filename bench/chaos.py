"""The chaos run: one training run on a multi-JVM local cluster that survives, in order and at random steps,
a killed Python worker, a killed executor JVM, a dropped PS connection, a worker stalled past its deadline
and a driver kill followed by `--resume`, and loses nothing.

    .venv/bin/python bench/chaos.py [--dir /tmp/shardline-chaos] [--seed 0] [--epochs 6] [--master local-cluster[2,1,1024]]

Everything is injected from outside, as it happens in production: SIGKILL to the rank's Python worker, to
its executor JVM, `ss -K` on the rank's TCP connection to the parameter server (root), SIGSTOP of the rank's
Python worker for longer than timeouts.step_s (SIGCONT after), SIGKILL to the driver's process group and
then `run_pipeline --resume`. Where training is (the step) and which process runs a rank come from the
`faults.record_rows_dir` record (one JSON line per step per rank, in files named by rank and pid).

Then it checks: every (rank, step) applied exactly once (the final checkpoint's `steps_applied_by_rank`,
and one record per (rank, step) whose rows are every train row once per epoch), every epoch's metrics
present once in MLflow, and test accuracy within 0.5 pp of the same run without faults (run first). It
prints a table: fault, injected at step, recovered?, recovery seconds (from the injection until the first
step of the next attempt, or of the resumed driver: detection, the failed attempt's teardown, scheduling
the retry, the workers' start; for the driver kill the whole restart). Exit status 0 only if every check holds.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FAULTS = ("python worker killed", "executor JVM killed", "PS connection dropped", "worker stalled past deadline",
          "driver killed, --resume")
STEP_S = 6.0  # timeouts.step_s of the run: the stall lasts longer


@dataclass
class Injection:
    fault: str
    step: int  # the highest step any rank had recorded when the fault was injected
    at: float  # time.time() of the injection
    generation: int = 0  # the newest attempt generation recorded by then
    driver: int = 0  # which driver process ran (0: the first; the --resume one: 1)
    recovered_at: Optional[float] = None

    @property
    def recovered(self) -> bool:
        return self.recovered_at is not None

    @property
    def seconds(self) -> Optional[float]:
        return None if self.recovered_at is None else self.recovered_at - self.at


# -- the pure parts (tests/bench/test_chaos.py) -------------------------------------------------------
def plan_steps(rng: random.Random, total: int, count: int, margin: int) -> list[int]:
    """``count`` increasing injection steps in (margin, total - margin), at least ``margin`` apart, random."""
    span = (total - 2 * margin) // count
    if span <= margin:
        raise ValueError(f"{total} steps are too few for {count} faults {margin} steps apart; train longer")
    return [margin + i * span + rng.randrange(0, span - margin) for i in range(count)]


def settle(injections: list[Injection], records: list[dict]) -> None:
    """Each injection's recovery: the first step recorded after it by a later attempt (a higher generation
    of the same driver) or, for the driver kill, by the resumed driver. A fault that failed no attempt
    is not recovered from (it did not happen as a fault). ``records``: every record (``all_records``),
    each with the driver that wrote it."""
    for injection in injections:
        later = [r["t"] for r in records if r["t"] > injection.at and
                 (r["driver"] > injection.driver or r["driver"] == injection.driver
                  and r["generation"] > injection.generation)]
        injection.recovered_at = min(later) if later else None


def all_records(folder: Path, resumed_at: Optional[float] = None) -> list[dict]:
    """Every step record of the run, undone ones included (read_steps keeps only the last per step), each
    marked with its driver: 1 when written after ``resumed_at`` (the --resume driver's start), else 0."""
    found = []
    for path in sorted(folder.glob("rank*-pid*.jsonl")):
        with open(path) as lines:
            for line in lines:
                if line.strip():
                    entry = {k: v for k, v in json.loads(line).items() if k != "rows"}
                    entry.setdefault("generation", 0)
                    entry["driver"] = int(resumed_at is not None and entry["t"] >= resumed_at)
                    found.append(entry)
    return found


def accounting(records: list[dict], every_row: collections.Counter, epochs: int, world: int,
               applied: dict, total_steps: int) -> list[str]:
    """What breaks exactly-once, as readable problems (none: it held). ``records``: the last record of each
    (rank, step) (pipeline.worker.row_log.read_steps); ``applied``: the PS's steps_applied_by_rank."""
    problems = []
    keys = [(r["rank"], r["step"]) for r in records]
    expected = {(rank, step) for rank in range(world) for step in range(total_steps)}
    if set(keys) != expected:
        problems.append(f"(rank, step) records: {len(expected - set(keys))} missing, {len(set(keys) - expected)} extra")
    if {int(k): int(v) for k, v in applied.items()} != {rank: total_steps for rank in range(world)}:
        problems.append(f"steps_applied_by_rank is {applied}, expected {total_steps} for each of {world} ranks")
    for epoch in range(epochs):
        seen = collections.Counter(d for r in records if r["epoch"] == epoch for d in r["rows"])
        if seen != every_row:
            problems.append(f"epoch {epoch}: {sum((seen - every_row).values())} rows extra, "
                            f"{sum((every_row - seen).values())} missing")
    return problems


def epochs_once(logged_steps: list[int], epochs: int) -> bool:
    """MLflow's history of an epoch metric: each epoch exactly once."""
    return sorted(logged_steps) == list(range(epochs))


def table(injections: list[Injection]) -> str:
    lines = [f"{'fault':<32} {'injected at step':>16} {'recovered?':>10} {'recovery s':>10}"]
    for i in injections:
        lines.append(f"{i.fault:<32} {i.step:>16} {'yes' if i.recovered else 'NO':>10} "
                     f"{'-' if i.seconds is None else format(i.seconds, '.1f'):>10}")
    return "\n".join(lines)


# -- processes --------------------------------------------------------------------------------------
def _env() -> dict:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "MLFLOW_DISABLE_TELEMETRY": "true", "SPARK_LOCAL_IP": "127.0.0.1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def submit(master: str, overrides: list[str], log: Path, resume: bool = False) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("spark-submit")), "--master", master, "--conf",
               "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1", "--conf",
               "spark.executor.memory=768m", str(REPO / "jobs" / "run_pipeline.py"), *(["--resume"] if resume else []),
               "--config", str(REPO / "conf" / "digits.yaml"), *overrides]
    return subprocess.Popen(command, cwd=log.parent, env=_env(), stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def executor_jvm(pid: int) -> int:
    """The executor JVM above a Python worker (worker -> pyspark.daemon -> CoarseGrainedExecutorBackend)."""
    while pid > 1:
        pid = _ppid(pid)
        if "CoarseGrainedExecutorBackend" in _cmdline(pid):
            return pid
    raise RuntimeError("no executor JVM above the Python worker (not a local-cluster master?)")


class Progress:
    """The run's step record, read back from faults.record_rows_dir."""

    def __init__(self, folder: Path):
        self.folder = folder

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("rank*-pid*.jsonl"), key=lambda p: p.stat().st_mtime) \
            if self.folder.is_dir() else []

    def step(self) -> int:
        """The highest step recorded (-1: none yet)."""
        best = -1
        for path in self.files():
            with open(path, "rb") as f:
                start = max(0, path.stat().st_size - 65536)
                f.seek(start)
                for line in f.read().splitlines()[1 if start else 0:]:  # a seek may land mid-line
                    try:
                        best = max(best, json.loads(line)["step"])
                    except ValueError:
                        continue
        return best

    def generation(self) -> int:
        """The newest attempt generation in the newest record file (0: none yet)."""
        files = self.files()
        if not files:
            return 0
        with open(files[-1], "rb") as f:
            last = f.read().splitlines()[-1:]
        return int(json.loads(last[0]).get("generation", 0)) if last else 0

    def worker_pid(self, rank: int) -> int:
        """The Python worker that recorded ``rank``'s latest step."""
        newest = [p for p in self.files() if p.name.startswith(f"rank{rank}-")][-1]
        return int(re.search(r"pid(\d+)", newest.name).group(1))


def ps_port(log: Path) -> int:
    found = re.findall(r"parameter server shard 0 listening on [\w.:-]+:(\d+)", log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"no PS address in {log}")
    return int(found[-1])


def drop_connection(port: int, pid: int) -> None:
    """`ss -K` on the TCP connection(s) of Python worker ``pid`` to the PS (needs root / CAP_NET_ADMIN)."""
    listing = subprocess.run(["ss", "-tnpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
    sports = [re.search(r"127\.0\.0\.1:(\d+)\s+127", line).group(1) for line in listing.splitlines()
              if f"pid={pid}," in line]
    if not sports:
        raise RuntimeError(f"no connection of pid {pid} to the PS port {port}:\n{listing}")
    for sport in sports:
        subprocess.run(["ss", "-K", "dst", f"127.0.0.1:{port}", "sport", "=", f":{sport}"], check=True,
                       capture_output=True)


def wait_step(progress: Progress, step: int, driver: subprocess.Popen, deadline: float) -> int:
    while True:
        now = progress.step()
        if now >= step:
            return now
        if driver.poll() is not None:
            raise RuntimeError(f"the driver exited ({driver.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"step {step} not reached in time (at {now})")
        time.sleep(0.05)


def inject(fault: str, rank: int, progress: Progress, log: Path, driver: subprocess.Popen) -> None:
    pid = progress.worker_pid(rank)
    if fault == FAULTS[0]:
        os.kill(pid, signal.SIGKILL)
    elif fault == FAULTS[1]:
        os.kill(executor_jvm(pid), signal.SIGKILL)
    elif fault == FAULTS[2]:
        drop_connection(ps_port(log), pid)
    elif fault == FAULTS[3]:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(STEP_S + 4)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # the cancelled attempt's task was killed meanwhile
            pass
    elif fault == FAULTS[4]:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)


def overrides(workdir: Path, epochs: int, record: Optional[Path]) -> list[str]:
    out = [f"workdir={workdir}", f"tracking.uri=sqlite:///{workdir}/mlflow.db", "tracking.log_model=false",
           f"train.epochs={epochs}", "train.checkpoint_every=15", "train.max_attempts=8", f"timeouts.step_s={STEP_S}",
           # a steady pace (35 ms/step on rank 0, in every attempt), so faults land mid-training
           "faults.delay_rank=0", "faults.delay_ms=35", "faults.attempts=100"]
    return out + ([f"faults.record_rows_dir={record}"] if record else [])


def run_once(master: str, workdir: Path, epochs: int, record: Optional[Path], resume: bool = False,
             timeout: float = 900) -> tuple[int, str]:
    log = workdir / ("resume.log" if resume else "driver.log")
    driver = submit(master, overrides(workdir, epochs, record), log, resume)
    driver.wait(timeout=timeout)
    return driver.returncode, log.read_text(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/shardline-chaos")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    args = parser.parse_args()
    root = Path(args.dir)
    subprocess.run(["rm", "-rf", str(root)], check=True)
    baseline_dir, chaos_dir = root / "baseline", root / "chaos"
    baseline_dir.mkdir(parents=True)
    chaos_dir.mkdir(parents=True)
    rng = random.Random(args.seed)

    print("baseline (no faults) ...", flush=True)
    code, out = run_once(args.master, baseline_dir, args.epochs, None)
    if code != 0:
        print(out[-4000:])
        return 1
    baseline_run = re.search(r"mlflow run id: (\w+)", out).group(1)

    from pipeline.config import load
    from pipeline.shards import load_manifest, steps_per_epoch
    from pipeline.config.workdir import Workdir

    record = chaos_dir / "rows"
    cfg = load(REPO / "conf" / "digits.yaml", overrides(chaos_dir, args.epochs, record))
    manifest = load_manifest(Workdir.of(load(REPO / "conf" / "digits.yaml",
                                             overrides(baseline_dir, args.epochs, None))).shards)
    total = steps_per_epoch(manifest, cfg.parallelism.data, cfg.train.batch_size) * args.epochs
    at = plan_steps(rng, total, len(FAULTS), margin=max(8, total // 40))
    print(f"chaos run: {total} steps, faults at steps {at} ...", flush=True)

    progress = Progress(record)
    log = chaos_dir / "driver.log"
    driver = submit(args.master, overrides(chaos_dir, args.epochs, record), log)
    injections, resumed_at = [], None
    try:
        deadline = time.monotonic() + 900
        for fault, step in zip(FAULTS, at):
            reached = wait_step(progress, step, driver, deadline)
            rank = rng.randrange(cfg.parallelism.data)
            injection = Injection(fault, reached, time.time(), progress.generation(), driver=0)
            print(f"  step {reached}: {fault} (rank {rank})", flush=True)
            inject(fault, rank, progress, log, driver)
            injections.append(injection)
            if fault == FAULTS[4]:
                resumed_at = time.time()
                driver = submit(args.master, overrides(chaos_dir, args.epochs, record), chaos_dir / "resume.log",
                                resume=True)
            else:  # the next fault only once a new attempt is stepping
                while progress.generation() <= injection.generation:
                    if driver.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"no new attempt after: {fault}")
                    time.sleep(0.05)
        driver.wait(timeout=900)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    out = (chaos_dir / "resume.log").read_text(errors="replace")
    if driver.returncode != 0:
        print(out[-4000:])
        return 1

    from mlflow.tracking import MlflowClient

    from pipeline.checkpoints import CheckpointStore
    from pipeline.data import read_tensors
    from pipeline.worker.row_log import read_steps, row_digests

    records = read_steps(str(record))
    settle(injections, all_records(record, resumed_at))
    (root / "injections.json").write_text(json.dumps([vars(i) for i in injections], indent=1))
    store = CheckpointStore(Workdir.of(cfg).checkpoints)
    final = store.load(store.latest())
    x, y = read_tensors(manifest.files("train"), manifest.features_field, manifest.label_field,
                        manifest.num_features, manifest.feature_set)
    problems = accounting(records, collections.Counter(row_digests(x, y)), args.epochs, cfg.parallelism.data,
                          final["ps"]["steps_applied_by_rank"], total)
    chaos_run = re.search(r"mlflow run id: (\w+)", out).group(1)
    client = MlflowClient(f"sqlite:///{chaos_dir}/mlflow.db")
    if not epochs_once([m.step for m in client.get_metric_history(chaos_run, "train_loss")], args.epochs):
        problems.append("MLflow: the epochs' train_loss are not each logged once: "
                        f"{sorted(m.step for m in client.get_metric_history(chaos_run, 'train_loss'))}")
    accuracy = client.get_run(chaos_run).data.metrics["test_accuracy"]
    base = MlflowClient(f"sqlite:///{baseline_dir}/mlflow.db").get_run(baseline_run).data.metrics["test_accuracy"]
    if abs(accuracy - base) > 0.005:
        problems.append(f"test accuracy {accuracy:.4f} vs {base:.4f} without faults: more than 0.5 pp apart")
    if not all(i.recovered for i in injections):
        problems.append("a fault was not recovered from")
    print()
    print(table(injections))
    print(f"\nsteps {total} x {cfg.parallelism.data} ranks; test accuracy {accuracy:.4f} (without faults {base:.4f}); "
          f"failed attempts in the first driver: {len(re.findall('attempt [0-9]+ of', log.read_text(errors='replace')))}")
    print("exactly once: " + ("held" if not problems else "BROKEN: " + "; ".join(problems)))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
