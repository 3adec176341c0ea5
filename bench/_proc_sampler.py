"""Where a command's memory and CPU go, process by process: the RSS (VmRSS) and CPU ticks of a process
and everything below it, read from Linux /proc every interval in a thread, each process classified by
its cmdline as Spark builds its tree (the Python driver, the JVM, executor JVMs, pyspark.daemon and its
forked workers).

Why a tree and not the command alone: a Spark command's memory is mostly not in the process it started
(the JVM is its child, the Python workers the JVM's), and which of them grows with the data is what a
scale bench has to tell apart. Why /proc read directly: nothing beyond the standard library, and the
kernel's own high-water mark (VmHWM) comes with it, to check the samples against (a spike shorter than
the interval can pass between two of them). Why classify at every sample: a process may exec into
another program (spark-submit's bash becomes java) after it was first seen. run_sampled keeps the
command's output lines with the moment each arrived, so a caller can cut the samples at the moments
its steps log (a step's own window inside the whole command's).

Not a package: bench/ is on sys.path (the benches run as scripts; the tests load it by path).
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

# The figures TreeSampler.peaks gives per sample window (bytes): see its docstring.
KINDS = ("driver", "jvm", "executor", "max_worker", "workers", "tree")


# -- sampling a process tree from /proc --------------------------------------------------------------
def classify(cmdline: list[str]) -> str:
    """A process's kind from its argv: jvm (the Spark driver JVM: driver + executor in local mode),
    executor (an executor JVM of a cluster master), worker (a Spark Python worker), other."""
    if not cmdline:
        return "other"
    text = " ".join(cmdline)
    program = os.path.basename(cmdline[0])
    if program.startswith("java"):
        if "org.apache.spark.launcher.Main" in text:  # spark-submit's launcher: builds the command, exits
            return "other"
        if "CoarseGrainedExecutorBackend" in text or "org.apache.spark.deploy.worker" in text:
            return "executor"
        return "jvm"
    if "pyspark.daemon" in text or "pyspark.worker" in text:
        return "worker"
    return "other"


def read_proc(path: str) -> Optional[str]:
    """The text of a /proc file (or any), None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # gone, or not ours to read
        return None


def _stat(pid: int) -> Optional[tuple[int, float, int]]:
    """(ppid, CPU seconds, start time in ticks) of a pid from /proc/<pid>/stat, or None."""
    text = read_proc(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid ...
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[19])
    except (IndexError, ValueError):
        return None


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _status_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a pid in bytes (0 where unreadable or exited: a zombie has neither)."""
    text = read_proc(f"/proc/{pid}/status") or ""
    rss = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    hwm = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return (int(rss.group(1)) * 1024 if rss else 0), (int(hwm.group(1)) * 1024 if hwm else 0)


def descendants(root: int) -> list[int]:
    """root and every process below it (children, grandchildren, ...), from the ppids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


@dataclass
class Proc:
    """One process seen in the tree (a pid reused by another process is another Proc)."""

    pid: int
    ppid: int
    kind: str
    cmdline: str
    first_t: float
    last_t: float
    peak_rss: int = 0  # the largest sampled VmRSS, bytes
    hwm: int = 0  # the kernel's VmHWM at the last sample, bytes
    cpu_s: float = 0.0  # utime + stime at the last sample


@dataclass
class Sample:
    t: float  # time.monotonic()
    rss: dict[tuple, int]  # Proc key -> VmRSS bytes at this sample
    cpu_s: float  # the tree's cumulative CPU seconds up to this sample (every process ever seen)


class TreeSampler:
    """Samples the RSS and CPU of ``root`` and all its descendants every ``interval`` s in a thread,
    classifying each process by its cmdline (the root is ``root_kind``). Use as a context manager."""

    def __init__(self, root: int, interval: float = 0.5, root_kind: str = "driver",
                 classify_fn: Callable[[list[str]], str] = classify):
        self.root, self.interval, self.root_kind, self.classify_fn = root, interval, root_kind, classify_fn
        self.procs: dict[tuple, Proc] = {}
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-rss-sampler", daemon=True)

    def sample(self) -> Sample:
        now = time.monotonic()
        rss: dict[tuple, int] = {}
        for pid in descendants(self.root):
            stat = _stat(pid)
            if stat is None:
                continue
            ppid, cpu, start = stat
            key = (pid, start)
            vm_rss, hwm = _status_kb(pid)
            raw = read_proc(f"/proc/{pid}/cmdline") or ""
            argv = [a for a in raw.split("\0") if a]
            # the cmdline may change (spark-submit's bash execs java): classify at every sample
            kind = self.root_kind if pid == self.root else self.classify_fn(argv)
            proc = self.procs.get(key)
            if proc is None:
                proc = self.procs[key] = Proc(pid, ppid, kind, " ".join(argv)[:300], now, now)
            proc.kind, proc.last_t = kind, now
            if argv:
                proc.cmdline = " ".join(argv)[:300]
            proc.peak_rss = max(proc.peak_rss, vm_rss)
            proc.hwm = max(proc.hwm, hwm)
            proc.cpu_s = max(proc.cpu_s, cpu)
            if vm_rss:
                rss[key] = vm_rss
        sample = Sample(now, rss, sum(p.cpu_s for p in self.procs.values()))
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self, start: float = float("-inf"), end: float = float("inf")) -> dict[str, int]:
        """Peak bytes per kind over the samples in [start, end] (the nearest sample if none falls
        inside): driver, jvm, executor (summed over its processes at a sample), max_worker (the largest
        single worker), workers (their sum at one sample), tree (everything at one sample)."""
        inside = [s for s in self.samples if start <= s.t <= end]
        if not inside and self.samples:
            middle = (max(start, self.samples[0].t) + min(end, self.samples[-1].t)) / 2
            inside = [min(self.samples, key=lambda s: abs(s.t - middle))]
        out = dict.fromkeys(KINDS, 0)
        for s in inside:
            at = dict.fromkeys(KINDS, 0)
            for key, value in s.rss.items():
                kind = self.procs[key].kind
                if kind == "worker":
                    at["max_worker"] = max(at["max_worker"], value)
                    at["workers"] += value
                elif kind in at:
                    at[kind] += value
                at["tree"] += value
            for k in KINDS:
                out[k] = max(out[k], at[k])
        return out

    def cpu_between(self, start: float, end: float) -> float:
        """The tree's CPU seconds between the last samples at or before start and end."""
        def at(t: float) -> float:
            before = [s.cpu_s for s in self.samples if s.t <= t]
            return before[-1] if before else 0.0

        return max(0.0, at(end) - at(start))

    def hwm(self) -> dict[str, int]:
        """The kernel's VmHWM per kind: the largest single process's (driver, jvm, executor, max_worker)."""
        out = dict.fromkeys(("driver", "jvm", "executor", "max_worker"), 0)
        for p in self.procs.values():
            k = "max_worker" if p.kind == "worker" else p.kind
            if k in out:
                out[k] = max(out[k], p.hwm)
        return out

    def tree(self) -> list[dict]:
        """The processes seen, for --json: pid, ppid, kind, peak, hwm, CPU s, first/last seen (s from the
        first sample), cmdline (clipped)."""
        t0 = self.samples[0].t if self.samples else 0.0
        return [{**asdict(p), "first_t": round(p.first_t - t0, 2), "last_t": round(p.last_t - t0, 2)}
                for p in sorted(self.procs.values(), key=lambda p: p.first_t)]


# -- a command run with its tree sampled -------------------------------------------------------------
@dataclass
class Line:
    """A line the command wrote, and when: the caller times its steps by their log lines."""

    t: float  # time.monotonic() when it arrived
    stream: str
    text: str


def run_sampled(cmd: list[str], cwd: str, env: dict, interval: float, log_path: Optional[Path] = None,
                timeout_s: Optional[float] = None):
    """Run ``cmd`` with its process tree sampled and its stdout / stderr lines kept (and written to
    ``log_path``), killed after ``timeout_s``; returns (rc, wall s, start t, end t, lines, sampler)."""
    lines: list[Line] = []
    lock = threading.Lock()
    log = open(log_path, "w") if log_path else None

    def pump(stream, name: str) -> None:
        for raw in iter(stream.readline, ""):
            line = Line(time.monotonic(), name, raw.rstrip("\n"))
            with lock:
                lines.append(line)
                if log:
                    log.write(f"[{name}] {line.text}\n")
        stream.close()

    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace")
    pumps = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
    for p in pumps:
        p.start()
    try:
        with TreeSampler(proc.pid, interval) as sampler:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic()
    for p in pumps:
        p.join(timeout=10)
    if log:
        log.close()
    return rc, end - start, start, end, lines, sampler
