"""How many OpenMP threads a parameter-server thread's tensor math uses (``ps.server_threads``), set in
that thread alone.

Why per thread, through the OpenMP runtime torch loaded, instead of ``torch.set_num_threads``: the server
lives in the driver (or a Spark Connect client, or a notebook), whose own torch work (evaluation, the
user's code) keeps the process's setting; OpenMP's thread count is a per-thread setting, and ATen's
parallel loops read the calling thread's. Why it matters: a shard's sums and optimizer step are
memory-bound passes of a few ms; on a host whose cores the workers fill, splitting them over a second
OpenMP thread wakes (and, under libgomp's default wait policy, spins) a thread on a worker's core: 0.5-1 ms
more driver CPU per step of a 4.4 MB model, 2 workers on 2 cores (bench/step_profile_bench.py --compare
ps.server_threads=0), a step's time the same within the noise.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

SERVER_THREADS_KEY = "ps.server_threads"
# The OpenMP runtimes torch wheels link: GNU (Linux), LLVM and Intel (macOS, conda builds).
_RUNTIMES = ("libgomp", "libomp", "libiomp5")

_lock = threading.Lock()
_setter: Any = None  # omp_set_num_threads of the runtime torch's parallel loops use, once found
_candidates: Optional[list] = None  # the mapped runtimes' setters, torch's own first
_warned = False


def _loaded_runtimes() -> list[str]:
    """The OpenMP runtimes this process has mapped (/proc/self/maps), torch's own first: other wheels
    bring theirs (scikit-learn's vendored libgomp), whose thread count torch does not read."""
    import torch

    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/") and name.startswith(_RUNTIMES) and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        return []
    home = os.path.dirname(torch.__file__) + os.sep
    return sorted(found, key=lambda path: not path.startswith(home))


def _setters() -> list:
    global _candidates
    if _candidates is None:
        _candidates = []
        for path in _loaded_runtimes():
            try:
                setter = ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
            setter.argtypes, setter.restype = [ctypes.c_int], None
            _candidates.append(setter)
    return _candidates


def limit_this_thread(threads: int) -> bool:
    """Make the calling thread's torch ops use ``threads`` OpenMP threads (0: leave torch's default).
    True when torch now reports that many in this thread; False (logged once) where the runtime could not
    be found or did not take it: the server then runs as torch would anyway, only not limited."""
    global _setter, _warned
    import torch

    # ATen sets a thread's OpenMP count lazily, at its first parallel op or thread-count query; have that
    # happen now, so it cannot overwrite the count set below.
    if threads == 0 or torch.get_num_threads() == threads:
        return True
    with _lock:
        setters = [_setter] if _setter is not None else list(_setters())
    for setter in setters:  # the first whose count torch then reports is torch's runtime
        setter(threads)
        if torch.get_num_threads() == threads:
            _setter = setter
            return True
    if not _warned:
        _warned = True
        logger.warning("%s=%s: could not limit the parameter server's threads (no OpenMP runtime of torch's "
                       "found, or it ignored the call); they use torch's %s threads", SERVER_THREADS_KEY, threads,
                       torch.get_num_threads())
    return False
