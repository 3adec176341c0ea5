"""ps.server_threads (pipeline.ps.server.tensor_threads): the OpenMP threads of a server thread's tensor math, set in
that thread only; the process's own setting (the driver's torch work) stays as it was."""
from __future__ import annotations

import threading

import pytest
import torch

from pipeline.ps.server import tensor_threads
from pipeline.ps.server.tensor_threads import limit_this_thread


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(10)
    return out[0]


def test_one_thread_is_set_in_the_calling_thread_only() -> None:
    before = torch.get_num_threads()
    took, inside = _in_thread(lambda: (limit_this_thread(1), torch.get_num_threads()))
    assert took and inside == 1
    assert torch.get_num_threads() == before  # the process's (this thread's) count is untouched
    # Survives the thread's first parallel op, which is where ATen would set its own count lazily.
    assert _in_thread(lambda: (limit_this_thread(1), torch.ones(1 << 20).add_(1), torch.get_num_threads())[2]) == 1


def test_zero_leaves_torch_s_default() -> None:
    assert _in_thread(lambda: (limit_this_thread(0), torch.get_num_threads())) == (True, torch.get_num_threads())


def test_a_missing_runtime_is_logged_once_and_the_thread_keeps_torch_s_count(monkeypatch, caplog) -> None:
    if torch.get_num_threads() == 1:
        pytest.skip("torch already runs one thread here: an unlimited thread cannot be told apart")
    monkeypatch.setattr(tensor_threads, "_candidates", [])
    monkeypatch.setattr(tensor_threads, "_setter", None)
    monkeypatch.setattr(tensor_threads, "_warned", False)
    with caplog.at_level("WARNING", logger=tensor_threads.__name__):
        assert _in_thread(lambda: limit_this_thread(1)) is False
        assert _in_thread(lambda: limit_this_thread(1)) is False
    warnings = [r.getMessage() for r in caplog.records if r.name == tensor_threads.__name__]
    assert len(warnings) == 1 and "ps.server_threads=1" in warnings[0]


def test_torch_s_runtime_is_found_among_other_wheels_openmp_runtimes(monkeypatch) -> None:
    import ctypes
    import glob
    import os

    if torch.get_num_threads() == 1:
        pytest.skip("torch already runs one thread here: an unlimited thread cannot be told apart")
    sklearn_libs = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "scikit_learn.libs")
    foreign = sorted(glob.glob(os.path.join(sklearn_libs, "libgomp*.so*")))
    if not foreign:
        pytest.skip("no scikit-learn vendored libgomp in this environment")
    ctypes.CDLL(foreign[0])  # mapped in this process, as importing scikit-learn's OpenMP code does
    monkeypatch.setattr(tensor_threads, "_candidates", None)
    monkeypatch.setattr(tensor_threads, "_setter", None)
    runtimes = tensor_threads._loaded_runtimes()
    assert foreign[0] in runtimes and runtimes[0].startswith(os.path.dirname(torch.__file__))
    assert _in_thread(lambda: (limit_this_thread(1), torch.get_num_threads())) == (True, 1)
