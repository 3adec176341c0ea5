"""The served MLflow model predicts from RAW source rows (numbers, strings, image bytes, text, arrays):
in process, in an interpreter that cannot import shardline, and behind a real `mlflow models serve`,
equal to udfs.transforms.Transform + the network and to `shardline score` on the same rows."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Dict

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config.feature_spec import FeatureSet, FeatureSpec
from pipeline.tracking import start_run
from pipeline.models.trust import seal_model

LABELS = ["cat", "dog", "eel"]
CITIES = ["paris", "rome", "oslo", "lima"]
WORDS = ["red", "car", "fast", "blue"]
ROWS = 24
FEATURES = FeatureSet((
    FeatureSpec("age", "numeric", standardize=True, mean=40.0, std=12.0, source_type="bigint"),
    FeatureSpec("income", "numeric", standardize=True, mean=5.0, std=2.0, impute="mean", fill=5.0,
                missing_flag=True, source_type="double"),
    FeatureSpec("city", "categorical", vocab_size=len(CITIES), vocabulary="vocab/city.parquet",
                source_type="string"),
    FeatureSpec("device", "categorical", hash_buckets=16, source_type="bigint"),
    FeatureSpec("photo", "image", height=6, width=6, channels=3, source_type="binary"),
    FeatureSpec("title", "text", max_len=4, tokenize=True, vocab_size=len(WORDS), vocabulary="vocab/title.parquet",
                source_type="string"),
    FeatureSpec("emb", "vector", length=3, source_type="array<double>"),
))
INPUTS = [f.name for f in FEATURES]


def _image(seed: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)  # resized to 6x6
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def _raw_rows(n: int = ROWS) -> pd.DataFrame:
    """Raw source rows: unseen and null cities, null incomes (imputed), unknown and null titles."""
    rng = np.random.default_rng(7)
    cities = CITIES + ["nowhere", None]
    titles = ["Red car", "fast blue car!", "unknown words", None, "", "RED RED red car fast"]
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "age": rng.integers(18, 80, n).astype(np.int64),
        "income": [None if i % 5 == 0 else float(v) for i, v in enumerate(rng.normal(5, 2, n))],
        "city": [cities[i % len(cities)] for i in range(n)],
        "device": rng.integers(0, 1000, n).astype(np.int64),
        "photo": [_image(i, "JPEG" if i % 4 == 0 else "PNG") for i in range(n)],
        "title": [titles[i % len(titles)] for i in range(n)],
        "emb": [rng.normal(size=3).tolist() for _ in range(n)],
    }).astype({"income": "float64"})


def _arrow(rows: pd.DataFrame) -> pa.Table:
    """The rows as the source stores them (what `shardline score` reads and the ETL read)."""
    types = {"id": pa.int64(), "age": pa.int64(), "income": pa.float64(), "city": pa.string(),
             "device": pa.int64(), "photo": pa.binary(), "title": pa.string(), "emb": pa.list_(pa.float64())}
    return pa.table({c: pa.array(rows[c].tolist(), types[c]) for c in rows.columns if c in types})


def _network():
    from pipeline.models import ModelSpec, build_model

    torch.manual_seed(3)
    spec = ModelSpec(kind="mlp", num_features=FEATURES.numeric_width, num_outputs=len(LABELS),
                     task="classification", hidden=(16,), features=tuple(FEATURES.to_list()))
    return spec, build_model(spec).eval()


def _shard_set(root: Path):
    """A shard set's metadata (manifest.json + vocabulary files), no shards: what a run's data/ holds."""
    from pipeline.shards.manifest import Manifest

    (root / "vocab").mkdir(parents=True)
    pq.write_table(pa.table({"value": CITIES}), root / "vocab" / "city.parquet")
    pq.write_table(pa.table({"value": WORDS}), root / "vocab" / "title.parquet")
    numeric = FEATURES.numeric
    manifest = Manifest(name="served", task="classification", feature_columns=tuple(FEATURES.numeric_columns),
                        label_column="label", label_mapping=tuple(LABELS), standardized=True,
                        means=tuple(f.mean for f in numeric), stds=tuple(f.std for f in numeric), splits={},
                        fingerprint="sha256:" + "0" * 64, features=tuple(FEATURES.to_list()), root=str(root))
    manifest.write(root)
    return manifest


def _expected(model, vocabularies: dict, rows: pd.DataFrame):
    """Transform + the network in this process: (label values, probabilities)."""
    from udfs.transforms import Transform

    arrays, valid, _, _ = Transform(FEATURES.to_list(), vocabularies).apply(_arrow(rows))
    assert valid.all()
    with torch.no_grad():
        logits = model({k: torch.from_numpy(v) for k, v in arrays.items()})
    probabilities = torch.softmax(logits.to(torch.float64), dim=1).numpy()
    return [LABELS[i] for i in probabilities.argmax(axis=1)], probabilities


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One tracked run holding what shardline logs: data/manifest.json, data/vocab/*.parquet,
    shardline/model.pt (spec + flat parameters) and the served pyfunc `model`."""
    from pipeline.models import flat_parameters

    root = tmp_path_factory.mktemp("served")
    uri = f"sqlite:///{root}/mlflow.db"
    manifest = _shard_set(root / "shards")
    spec, model = _network()
    rows = _raw_rows()
    torch.save(seal_model(spec.to_dict(), flat_parameters(model)), root / "model.pt")
    started = time.perf_counter()
    with start_run(uri, "served-model") as run:
        run.log_manifest(manifest)
        run.log_file(root / "model.pt", "shardline")
        logged = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model_uri = run.log_model(model, manifest.feature_set, manifest.vocabulary_files(), "classification",
                                      list(LABELS), rows.head(5))
    timings = {"log_model_s": time.perf_counter() - logged, "run_s": time.perf_counter() - started}
    for w in caught:  # still in pytest's warnings summary
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    vocabularies = manifest.vocabularies()
    return SimpleNamespace(root=root, uri=uri, run_id=run.run_id, model_uri=model_uri, model=model, rows=rows,
                           vocabularies=vocabularies, manifest=manifest, timings=timings,
                           log_warnings=[str(w.message) for w in caught])


@pytest.fixture
def tracked(served):
    """`served`, with its store as MLflow's tracking URI again (the package conftest resets it after each
    test; models:/m-<id> URIs resolve through it)."""
    import mlflow

    mlflow.set_tracking_uri(served.uri)
    return served


def test_run_holds_the_manifest_vocabularies_and_a_self_contained_model(tracked, tmp_path):
    served = tracked
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(served.uri)
    data = {a.path for a in client.list_artifacts(served.run_id, "data")}
    assert data == {"data/manifest.json", "data/vocab"}
    assert {a.path for a in client.list_artifacts(served.run_id, "data/vocab")} == \
        {"data/vocab/city.parquet", "data/vocab/title.parquet"}
    folder = Path(mlflow.artifacts.download_artifacts(served.model_uri, dst_path=str(tmp_path)))
    shipped = folder / "artifacts" / "shardline"
    info = json.loads((shipped / "features.json").read_text())
    assert info["torch_format"] == "torch.export" and (shipped / "model.pt2").is_file()
    assert info["labels"] == LABELS and info["label_type"] == "string" and info["task"] == "classification"
    assert [c["name"] for c in info["inputs"]] == INPUTS
    assert {c["name"]: c["type"] for c in info["inputs"]} == {
        "age": "long", "income": "double", "city": "string", "device": "long", "photo": "binary",
        "title": "string", "emb": "array<double>"}
    assert pq.read_table(shipped / "vocab" / "city.parquet").column("value").to_pylist() == CITIES
    # The shipped transforms are udfs/transforms.py, byte for byte, under a module name of their own.
    assert (folder / "code" / "shardline_transforms.py").read_bytes() == \
        (Path(__file__).resolve().parents[3] / "udfs" / "transforms.py").read_bytes()
    pins = dict(line.split("==") for line in (folder / "requirements.txt").read_text().split())
    assert set(pins) >= {"mlflow", "torch", "numpy", "pandas", "pyarrow", "pillow"}
    assert pins["torch"] == torch.__version__.split("+")[0] and pins["mlflow"] == mlflow.__version__
    signature = mlflow.models.get_model_info(served.model_uri).signature
    assert signature.inputs.input_names() == INPUTS
    assert signature.outputs.input_names() == ["prediction", "probability"]


def test_pyfunc_predicts_raw_rows_like_the_transform_and_network(tracked):
    served = tracked
    import mlflow.pyfunc

    loaded = mlflow.pyfunc.load_model(served.model_uri)
    got = loaded.predict(served.rows[INPUTS])
    labels, probabilities = _expected(served.model, served.vocabularies, served.rows)
    assert list(got.columns) == ["prediction", "probability"]
    assert got["prediction"].tolist() == labels
    np.testing.assert_allclose(np.array(got["probability"].tolist()), probabilities, rtol=1e-5, atol=1e-6)
    one = loaded.predict(served.rows[INPUTS].iloc[[3]])  # a single row: the batch dimension is dynamic
    assert one["prediction"].tolist() == labels[3:4]

    broken = served.rows[INPUTS].head(4).copy()
    broken.at[1, "photo"] = b"not an image"
    broken.at[2, "emb"] = [1.0, 2.0]
    with pytest.raises(ValueError, match=r"2 of 4 input rows are invalid.*'photo': 1.*'emb': 1|"
                                         r"2 of 4 input rows are invalid.*'emb': 1.*'photo': 1"):
        loaded.predict(broken)


def test_mlflow_takes_the_type_hints_and_refuses_a_column_of_the_wrong_type(tracked):
    served = tracked
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = mlflow.pyfunc.load_model(served.model_uri)  # runs udfs/served_model.py again
    hinted = [m for m in served.log_warnings + [str(w.message) for w in caught] if "type hint" in m.lower()]
    assert hinted == []  # without predict's hints MLflow warns "Add type hints ..." at log and at load
    # The explicit signature is kept (a DataFrame hint infers none) and MLflow enforces it before predict.
    assert mlflow.models.get_model_info(served.model_uri).signature.inputs.input_names() == INPUTS
    rows = served.rows[INPUTS].head(2)
    with pytest.raises(MlflowException, match=r"(?s)Failed to enforce schema.*column age"):
        loaded.predict(rows.assign(age=["forty", "fifty"]))
    with pytest.raises(MlflowException, match=r"(?s)Failed to enforce schema.*emb"):
        loaded.predict(rows.assign(emb=[1.0, 2.0]))


# Runs with -I -S: no PYTHONPATH, no user site, and this environment's site-packages (argv[1]) added by
# hand so its .pth files (the editable install's finder for shardline) never run; from a temp cwd, so the
# repository is not on sys.path.
_WITHOUT_SHARDLINE = r"""
import importlib.util, json, sys
sys.path.append(sys.argv[1])
for name in ("pipeline", "udfs", "shardline_transforms"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable: the isolation is broken"
import base64
import mlflow.pyfunc, pandas as pd
request = json.loads(sys.stdin.read())
rows = pd.DataFrame(request["data"], columns=request["columns"])
rows["photo"] = rows["photo"].map(base64.b64decode)
model = mlflow.pyfunc.load_model(request["model_uri"])
out = model.predict(rows)
assert "pipeline" not in sys.modules and "udfs" not in sys.modules, sorted(sys.modules)
print(json.dumps({"prediction": out["prediction"].tolist(), "probability": out["probability"].tolist(),
                  "transforms": sys.modules["shardline_transforms"].__file__}))
"""


def _split_payload(rows: pd.DataFrame) -> dict:
    """MLflow's `dataframe_split` form of raw rows: binary columns base64, NaN as null."""
    data = []
    for record in rows[INPUTS].itertuples(index=False):
        row = []
        for name, value in zip(INPUTS, record):
            if name == "photo":
                value = base64.b64encode(value).decode("ascii")
            elif isinstance(value, float) and np.isnan(value):
                value = None
            elif isinstance(value, np.integer):
                value = int(value)
            row.append(value)
        data.append(row)
    return {"columns": INPUTS, "data": data}


def test_loads_and_predicts_in_an_interpreter_without_shardline(served, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MLFLOW_"))}
    env.update({"MLFLOW_TRACKING_URI": served.uri, "MLFLOW_DISABLE_TELEMETRY": "true"})
    request = {"model_uri": served.model_uri, **_split_payload(served.rows)}
    import sysconfig

    site_packages = sysconfig.get_paths()["purelib"]
    done = subprocess.run([sys.executable, "-I", "-S", "-c", _WITHOUT_SHARDLINE, site_packages],
                          input=json.dumps(request),
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "/code/" in got["transforms"]  # the model's own copy
    labels, probabilities = _expected(served.model, served.vocabularies, served.rows)
    assert got["prediction"] == labels
    np.testing.assert_allclose(np.array(got["probability"]), probabilities, rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, log: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if server.poll() is not None:
            pytest.fail(f"mlflow models serve exited with {server.returncode} before answering /ping:\n"
                        f"{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"mlflow models serve did not answer {url}/ping within {deadline_s:.0f} s:\n"
                        f"{log.read_text()[-4000:]}")
        time.sleep(0.25)


def _stop(server: subprocess.Popen) -> None:
    """The server and the uvicorn worker it started: one process group, ours (start_new_session)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _score_predictions(spark, served, tmp_path) -> pd.DataFrame:
    from pipeline.config.loader import build
    from pipeline.score import score

    source = tmp_path / "raw.parquet"
    pq.write_table(_arrow(served.rows), source)
    cfg = build({"name": "served", "workdir": str(tmp_path / "work"), "tracking": {"uri": served.uri},
                 "score": {"keep_columns": ["id"]}})
    result = score(spark, cfg, f"runs:/{served.run_id}", str(source), str(tmp_path / "scored"))
    assert result.scored_rows == result.input_rows == ROWS and result.invalid_rows == 0
    return pq.read_table(tmp_path / "scored").to_pandas().sort_values("id").reset_index(drop=True)


@pytest.mark.slow
def test_mlflow_models_serve_answers_raw_rows_like_pyfunc_and_shardline_score(tracked, spark, tmp_path):
    served = tracked
    import mlflow.pyfunc

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": served.uri, "MLFLOW_DISABLE_TELEMETRY": "true",
           # the server execs `uvicorn` by name: this environment's, not whatever PATH finds first
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    log = tmp_path / "serve.log"
    timings = dict(served.timings)
    started = time.perf_counter()
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", served.model_uri,
             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_ready(url, server, log, deadline_s=180)
        timings["serve_ready_s"] = time.perf_counter() - started
        body = json.dumps({"dataframe_split": _split_payload(served.rows)}).encode()
        request = urllib.request.Request(f"{url}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        posted = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            pytest.fail(f"/invocations answered {exc.code}: {exc.read()[:3000]!r}\n{log.read_text()[-3000:]}")
        timings["invocation_s"] = time.perf_counter() - posted
    finally:
        _stop(server)
    served_rows = answer["predictions"]
    assert len(served_rows) == ROWS

    local = mlflow.pyfunc.load_model(served.model_uri).predict(served.rows[INPUTS])
    assert [r["prediction"] for r in served_rows] == local["prediction"].tolist()
    np.testing.assert_allclose(np.array([r["probability"] for r in served_rows]),
                               np.array(local["probability"].tolist()), rtol=1e-6, atol=1e-9)

    scoring = time.perf_counter()
    scored = _score_predictions(spark, served, tmp_path)
    timings["score_s"] = time.perf_counter() - scoring
    assert scored["id"].tolist() == list(range(ROWS))
    assert scored["prediction"].tolist() == local["prediction"].tolist()
    np.testing.assert_allclose(np.array(scored["probability"].tolist()), np.array(local["probability"].tolist()),
                               rtol=1e-5, atol=1e-6)  # score writes float32 probabilities
    print("served-model timings:", json.dumps({k: round(v, 2) for k, v in timings.items()}))


class _Branchy(torch.nn.Module):
    """Branches on a tensor's value: torch.export refuses it, TorchScript keeps both paths."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["numeric"]
        if bool(x.sum() > 0):
            return self.layer(x)
        return -self.layer(x)


class _Unsavable(_Branchy):
    def forward(self, batch):  # unannotated: TorchScript takes `batch` for a Tensor
        return super().forward(batch)


def test_a_model_export_cannot_capture_is_served_as_torchscript(tmp_path):
    import mlflow
    import mlflow.pyfunc

    from pipeline.tracking.served import ServedModelError

    features = FeatureSet.numeric_only(["a", "b"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    positive = pd.DataFrame({"a": [1.0, 2.0], "b": [0.5, 1.5]})
    with start_run(uri, "torchscript") as run:
        model_uri = run.log_model(_Branchy(), features, {}, "regression", None, positive)
        with pytest.raises(ServedModelError, match="torch.export.*torch.jit.script"):
            run.log_model(_Unsavable(), features, {}, "regression", None, positive)
    folder = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "m")))
    assert json.loads((folder / "artifacts/shardline/features.json").read_text())["torch_format"] == "torchscript"
    negative = -positive
    model = _Branchy().eval()
    loaded = mlflow.pyfunc.load_model(model_uri)
    for rows in (positive, negative):  # both branches survive, unlike a trace
        with torch.no_grad():
            expected = model({"numeric": torch.tensor(rows.to_numpy(), dtype=torch.float32)})[:, 0].numpy()
        np.testing.assert_allclose(loaded.predict(rows)["prediction"].to_numpy(), expected, rtol=1e-6)
