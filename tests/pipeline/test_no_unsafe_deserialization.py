"""No code path may turn bytes into code or arbitrary objects: an AST scan of pipeline/, udfs/ and jobs/.

The parameter server listens on the driver and workers read checkpoints and models written by other
processes, so deserialization must be data-only. This scan fails on any call of an object deserializer
(pickle, cPickle/_pickle, cloudpickle, dill, joblib, marshal, shelve, pandas.read_pickle, yaml without a
safe loader), on
``numpy.load(allow_pickle=<anything but False>)``, on ``eval``/``exec``, and on ``torch.load`` without a
literal ``weights_only=True``. Names are resolved through imports (``import pickle as p``,
``from torch import load``), so an alias does not hide a call. The scanner itself is tested on synthetic
sources, so this test can fail.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("pipeline", "udfs", "jobs")

# Modules whose loading functions (or whose whole purpose) deserialize arbitrary Python objects.
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "marshal", "joblib"}
UNSAFE_CALLS = {
    **{f"{m}.{f}": "unpickles arbitrary objects" for m in ("pickle", "cPickle", "_pickle", "cloudpickle",
                                                           "dill")
       for f in ("load", "loads", "Unpickler")},
    "marshal.load": "unmarshals code objects", "marshal.loads": "unmarshals code objects",
    "shelve.open": "shelve unpickles its values", "shelve.Shelf": "shelve unpickles its values",
    "shelve.DbfilenameShelf": "shelve unpickles its values",
    "joblib.load": "joblib.load unpickles", "pandas.read_pickle": "read_pickle unpickles",
    "yaml.unsafe_load": "unsafe_load constructs arbitrary objects",
    "yaml.unsafe_load_all": "unsafe_load constructs arbitrary objects",
    "eval": "eval runs code", "exec": "exec runs code",
    "builtins.eval": "eval runs code", "builtins.exec": "exec runs code",
}
YAML_SAFE_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader"}
# Importing these at all is refused: they exist only to deserialize objects.
FORBIDDEN_IMPORTS = {"cPickle", "_pickle", "dill", "shelve", "marshal"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin, from every import in the module (any scope)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # `import a.b` binds `a`
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``np.load`` -> ``numpy.load`` through the module's imports; None for computed callees."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_literal(node: ast.expr | None, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def scan_source(source: str, filename: str = "<string>") -> list[str]:
    """Every unsafe deserialization/code-execution call in ``source``, as 'file:line: what'."""
    return scan_tree(ast.parse(source, filename=filename), filename)


def scan_tree(tree: ast.AST, filename: str) -> list[str]:
    aliases = _aliases(tree)
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_IMPORTS:
                    report(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in FORBIDDEN_IMPORTS:
                report(node, f"imports from {node.module}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name is None:
            continue
        # **kwargs / *args may carry the flag that makes a loader unsafe: refuse what cannot be read.
        has_kwargs = any(kw.arg is None for kw in node.keywords)
        has_star = any(isinstance(arg, ast.Starred) for arg in node.args)
        if name in UNSAFE_CALLS:
            report(node, f"{name}(): {UNSAFE_CALLS[name]}")
        elif name == "torch.load":
            if not _is_literal(_keyword(node, "weights_only"), True):
                report(node, "torch.load() without weights_only=True")
        elif name == "numpy.load":
            allow = _keyword(node, "allow_pickle")
            if (allow is not None and not _is_literal(allow, False)) or has_kwargs or has_star \
                    or len(node.args) > 2:  # the third positional parameter is allow_pickle
                report(node, "numpy.load() that may allow pickles (allow_pickle must be absent or False)")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader, aliases) not in YAML_SAFE_LOADERS:
                report(node, f"{name}() without a safe Loader (use yaml.safe_load)")
        elif name.split(".")[0] in UNSAFE_MODULES and name.rsplit(".", 1)[-1] in ("load", "loads"):
            report(node, f"{name}(): deserializes objects")
    return found


@functools.lru_cache(maxsize=1)
def parsed_sources() -> tuple[tuple[str, ast.AST], ...]:
    """(path relative to the repo, AST) of every .py file under SCANNED, parsed once per session."""
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20, f"the scan found only {len(files)} files under {SCANNED}: wrong root?"
    return tuple((str(p.relative_to(ROOT)), ast.parse(p.read_text(encoding="utf-8"), filename=str(p)))
                 for p in files)


def test_no_code_deserializes_objects_or_runs_code_from_bytes() -> None:
    found = [hit for name, tree in parsed_sources() for hit in scan_tree(tree, name)]
    assert found == [], "unsafe deserialization:\n" + "\n".join(found)


def test_the_scan_covers_every_module_that_reads_the_network() -> None:
    """Every module that decodes bytes from a socket (the frames, the handshake, the PS protocol and its
    connection opening, the stage links' frames, TLS and pending slots, the allreduce rendezvous store, the
    bucketed rounds) is among the scanned sources."""
    scanned = {name for name, _ in parsed_sources()}
    network = {"pipeline/wire/frames.py", "pipeline/wire/handshake.py", "pipeline/wire/tls.py",
               "pipeline/wire/pending.py", "pipeline/ps/transport/protocol.py", "pipeline/ps/transport/opening.py",
               "pipeline/ps/transport/listener.py", "pipeline/ps/server/dispatch.py", "pipeline/parallel/link.py",
               "pipeline/parallel/link_frames.py", "pipeline/worker/store.py", "pipeline/ps/client/bucket_rounds.py"}
    assert network <= scanned, sorted(network - scanned)


def test_the_scan_sees_the_torch_loads_that_exist() -> None:
    """The project does load checkpoints/models with torch.load: the scan must resolve and see those
    calls (all with weights_only=True, or the test above fails), not pass because it sees nothing."""
    seen = []
    for name, tree in parsed_sources():
        aliases = _aliases(tree)
        seen += [name for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and _dotted(node.func, aliases) == "torch.load"]
    assert seen, "no torch.load call found: the scan resolves names wrongly"


@pytest.mark.parametrize("source", [
    "import pickle\npickle.loads(data)",
    "import pickle\npickle.load(f)",
    "import pickle as p\np.loads(data)",
    "from pickle import loads\nloads(data)",
    "from pickle import loads as l\nl(data)",
    "import pickle\npickle.Unpickler(f).load()",
    "import _pickle\n",
    "import cPickle\n",
    "import cloudpickle\ncloudpickle.loads(data)",
    "from cloudpickle import load\nload(f)",
    "import dill\n",
    "import shelve\n",
    "import marshal\n",
    "import joblib\njoblib.load(path)",
    "import pandas as pd\npd.read_pickle(path)",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "import numpy\nnumpy.load(f, allow_pickle=flag)",
    "import numpy as np\nnp.load(f, **kw)",
    "import numpy as np\nnp.load(*args)",
    "import numpy as np\nnp.load(f, None, True)",
    "from numpy import load\nload(f, allow_pickle=True)",
    "eval(text)",
    "exec(code)",
    "import builtins\nbuiltins.eval(text)",
    "def f(payload):\n    return eval(payload)",
    "import torch\ntorch.load(f)",
    "import torch\ntorch.load(f, weights_only=False)",
    "import torch\ntorch.load(f, weights_only=flag)",
    "import torch\ntorch.load(f, weights_only=1)",
    "import torch\ntorch.load(f, **kw)",
    "import torch as t\nt.load(io.BytesIO(data))",
    "from torch import load\nload(f, map_location='cpu')",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.FullLoader)",
    "import yaml\nyaml.unsafe_load(text)",
    "class A:\n    def m(self):\n        import torch\n        return torch.load(self.f)",
])
def test_scanner_detects(source: str) -> None:
    assert scan_source(source), source


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(f, weights_only=True)",
    "import torch\ntorch.load(f, map_location='cpu', weights_only=True)",
    "from torch import load\nload(f, weights_only=True)",
    "import numpy as np\nnp.load(f)",
    "import numpy as np\nnp.load(f, allow_pickle=False)",
    "model.eval()",  # torch.nn.Module.eval: not the builtin
    "df.eval('a + b')",
    "import json\njson.loads(data)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import torch\ntorch.save(obj, f)",
    "import pickle\npickle.dumps(obj)",  # serializing is not the risk
    "load(f)",  # an unrelated local function
])
def test_scanner_accepts(source: str) -> None:
    assert scan_source(source) == [], source
