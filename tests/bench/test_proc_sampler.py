"""bench/_proc_sampler.py: processes classified by their cmdline as Spark builds its tree, and the /proc tree
sampler on real processes (a child and its grandchild, each holding a known amount of memory). No timing
asserts."""
from __future__ import annotations

import subprocess
import sys

import pytest

MB = 2**20


@pytest.fixture(scope="module")
def proc_sampler(load_bench):
    return load_bench("_proc_sampler")


def test_processes_are_classified_by_their_cmdline(proc_sampler):
    java = "/usr/lib/jvm/java-17-openjdk-amd64/bin/java"
    assert proc_sampler.classify([java, "-cp", "jars/*", "-Xmx4g", "org.apache.spark.deploy.SparkSubmit",
                                  "pyspark-shell"]) == "jvm"
    assert proc_sampler.classify([java, "-cp", "jars/*", "org.apache.spark.executor.CoarseGrainedExecutorBackend"]) \
        == "executor"
    assert proc_sampler.classify(["java", "-Xmx128m", "-cp", "jars/*", "org.apache.spark.launcher.Main"]) == "other"
    assert proc_sampler.classify([sys.executable, "-m", "pyspark.daemon", "pyspark.worker"]) == "worker"
    assert proc_sampler.classify([sys.executable, "-c", "pass"]) == "other"
    assert proc_sampler.classify([]) == "other"


def test_the_sampler_sees_a_child_and_its_grandchild_at_their_peaks(proc_sampler):
    # the child touches ~110 MB and starts a grandchild that touches ~60 MB; both hold it for a while
    grandchild = "import time; y = b'\\x01' * (60 * 2**20); time.sleep(1.5)"
    child = (f"import subprocess, sys, time; x = b'\\x01' * (110 * 2**20); "
             f"subprocess.run([sys.executable, '-c', {grandchild!r}]); time.sleep(0.3)")
    proc = subprocess.Popen([sys.executable, "-c", child])
    with proc_sampler.TreeSampler(proc.pid, interval=0.1) as sampler:
        assert proc.wait(timeout=60) == 0
    peaks = sampler.peaks()
    assert peaks["driver"] >= 100 * MB  # the root is the "driver" kind
    assert peaks["tree"] >= 160 * MB  # both at one sample
    assert peaks["jvm"] == peaks["max_worker"] == 0
    others = [p for p in sampler.procs.values() if p.pid != proc.pid]
    assert any(p.kind == "other" and p.ppid == proc.pid and p.peak_rss >= 55 * MB for p in others)
    assert sampler.hwm()["driver"] >= 100 * MB
    assert sampler.cpu_between(sampler.samples[0].t, sampler.samples[-1].t) > 0
    # a window holds only its own samples: before the child allocated, its RSS was far lower
    assert sampler.peaks(end=sampler.samples[0].t)["driver"] < peaks["driver"]
