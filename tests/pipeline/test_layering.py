"""The import arrows of DESIGN.md, checked on the source (lazy imports included) and in fresh interpreters."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# module -> pipeline modules it may import (besides itself and pipeline.errors)
ALLOWED = {
    "config": {"storage"},
    "errors": set(),
    "storage": set(),
    "tables": {"config", "storage"},  # Delta/Iceberg: pinned reads, changes between versions, appends
    "etl": {"config", "shards", "storage", "tables"},
    "shards": {"config", "storage"},
    "data": {"shards", "storage"},
    "models": {"config", "ps"},  # ShardlineEmbedding: a sparse table's spec and seeded rows (pipeline.ps.sparse)
    "wire": set(),
    "ps": {"wire"},
    "checkpoints": {"storage"},
    "parallel": {"ps", "models", "wire", "data"},
    "worker": {"data", "models", "ps", "parallel", "wire"},
    "launch": {"config", "worker", "ps", "shards", "models", "data", "checkpoints", "parallel", "wire", "storage",
               "executors"},
    "executors": set(),  # what Spark knows of its executors (classic sessions; launch never touches the context)
    "evaluate": {"models", "shards", "data", "storage"},
    "tracking": {"config", "storage"},
    "session": {"config"},
    "notebook": set(),
    "steps": {"config", "etl", "shards", "data", "models", "launch", "evaluate", "tracking", "checkpoints",
              "storage"},
    "workflow": {"config", "etl", "shards", "steps", "tracking", "tables", "storage"},
    "tune": {"config", "steps", "tracking"},
    "cli": {"config", "session", "steps", "workflow", "score", "tune"},
    "spark_ml": {"config", "etl", "launch", "evaluate", "models", "steps", "tracking"},
    "score": {"config", "shards", "models", "tracking", "storage", "tables"},
}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports (lazy imports included). ``from a.b import c`` is an arrow to
    ``a.b.c`` when that is a module, else to ``a.b``; a package's ``__init__`` counts only when imported."""
    files = {_dotted(p): p for top in ("pipeline", "udfs") for p in (REPO / top).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        arrows = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                arrows |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
                arrows |= found or ({base} if base in files else set())
        graph[name] = arrows - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_project_modules():
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    real = _import_graph()
    assert "pipeline.launch.train" in real["pipeline.launch"]  # lazy and package imports are followed


@pytest.mark.parametrize("path", sorted(p for top in ("pipeline", "udfs") for p in (REPO / top).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 450, f"{path.relative_to(REPO)} has {lines} lines: split it by what each part owns"


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO / "pipeline")
    return rel.parts[0].removesuffix(".py")


def test_every_module_has_an_arrow():
    names = {_module_of(p) for p in (REPO / "pipeline").rglob("*.py") if p.name != "__init__.py" or
             p.parent != REPO / "pipeline"}
    assert names <= set(ALLOWED), names - set(ALLOWED)


@pytest.mark.parametrize("path", sorted((REPO / "pipeline").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_follow_the_arrows(path):
    if path == REPO / "pipeline" / "__init__.py":
        return
    owner = _module_of(path)
    for name in _imports(path):
        top = name.split(".")
        if top[0] == "pipeline" and len(top) > 1 and top[1] not in (owner, "errors"):
            assert top[1] in ALLOWED[owner], f"{path.relative_to(REPO)} imports {name}"
        if top[0] == "mlflow":
            assert owner == "tracking", f"only pipeline.tracking may import mlflow ({path})"
        if "BarrierTaskContext" in path.read_text():
            assert owner == "launch", f"only pipeline.launch may touch BarrierTaskContext ({path})"
        if top[0] == "pyspark":
            assert owner not in ("worker", "data", "ps", "models"), f"{path} must not import Spark"


def test_udfs_import_nothing_from_pipeline():
    for path in (REPO / "udfs").rglob("*.py"):
        assert not any(n.split(".")[0] == "pipeline" for n in _imports(path)), path


@pytest.mark.parametrize("module", ["pipeline.config", "pipeline.ps", "pipeline.worker", "pipeline.data",
                                    "pipeline.launch", "pipeline.shards", "pipeline.tracking", "pipeline.cli"])
def test_fresh_import_pulls_no_heavy_optional_dependency(module):
    code = (f"import sys, {module}; heavy = [m for m in ('mlflow', 'pyspark', 'matplotlib') if m in sys.modules];"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"
