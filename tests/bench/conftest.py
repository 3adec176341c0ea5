"""The bench scripts as modules, for their tests: bench/ is not a package, so each script is loaded by path
(registered in sys.modules: dataclasses need their module), with bench/ on sys.path for the modules they
share (bench/_common.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def load_bench():
    """``load_bench("e2e_bench")``: bench/e2e_bench.py as a module, loaded once per session."""
    loaded: dict[str, object] = {}
    added = str(BENCH) not in sys.path
    if added:
        sys.path.append(str(BENCH))  # appended: a bench module never shadows an installed one

    def load(name: str):
        if name not in loaded:
            module_name = f"shardline_bench_{name}"
            spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
            loaded[name] = module
        return loaded[name]

    yield load
    for name in loaded:
        sys.modules.pop(f"shardline_bench_{name}", None)
    if added:
        sys.path.remove(str(BENCH))
