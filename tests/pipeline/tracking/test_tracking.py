import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.tracking import TrackingError, flatten_params, resolve_tracking_uri, start_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    """One SQLite store for the module: creating a fresh MLflow database costs ~1 s."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def _mlp(outputs: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, outputs))


class _DictMLP(nn.Module):
    """The batch-dict form every shardline model takes: batch['numeric'] -> logits (or one output)."""

    def __init__(self, outputs: int = 10):
        super().__init__()
        self.body = _mlp(outputs)

    def forward(self, batch):
        return self.body(batch["numeric"])


NAMES = [f"x{i:02d}" for i in range(64)]
def _features():
    from pipeline.config.feature_spec import FeatureSet

    return FeatureSet.numeric_only(NAMES)  # no standardization: the served model sees the raw values


def _batch(n: int = 16) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 64)).astype(np.float32)


def _rows(batch: np.ndarray):
    import pandas as pd

    return pd.DataFrame(batch.astype(np.float64), columns=NAMES)


def _artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for info in client.list_artifacts(run_id, path):
        found |= _artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return found


# --- tracking URI -------------------------------------------------------------------------------

def test_uri_config_wins_over_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_tracking_uri("http://config:5000", tmp_path) == "http://config:5000"


def test_uri_env_wins_over_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_tracking_uri(None, tmp_path) == "http://env:5000"
    assert resolve_tracking_uri("", tmp_path) == "http://env:5000"


def test_uri_defaults_to_sqlite_in_created_workdir(tmp_path):
    workdir = tmp_path / "runs" / "job1"
    uri = resolve_tracking_uri(None, workdir)
    assert uri == f"sqlite:///{workdir.resolve()}/mlflow.db"
    assert uri.startswith("sqlite:////")
    assert workdir.is_dir()


# --- params -------------------------------------------------------------------------------------

def test_flatten_params_nested_lists_and_truncation():
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    flat = flatten_params({"train": {"lr": 0.05, "epochs": 3, "opt": {"name": "sgd"}},
                           "model": {"hidden": [64, 32], "names": ["a", "b"]},
                           "seed": 7, "flag": True, "none": None, "long": "x" * 10_000})
    assert flat["train.lr"] == "0.05"
    assert flat["train.epochs"] == "3"
    assert flat["train.opt.name"] == "sgd"
    assert flat["model.hidden"] == "[64,32]"
    assert flat["model.names"] == '["a","b"]'
    assert flat["seed"] == "7" and flat["flag"] == "True" and flat["none"] == "None"
    assert len(flat["long"]) == MAX_PARAM_VAL_LENGTH and flat["long"].endswith("...")
    assert flatten_params({"lr": 1}, prefix="cfg") == {"cfg.lr": "1"}


# --- a full run ---------------------------------------------------------------------------------

def test_full_run_logs_everything_and_model_round_trips(tracking_uri, tmp_path):
    import mlflow
    import mlflow.pyfunc
    from mlflow import MlflowClient

    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"shards": 4}))
    history = [{"epoch": e, "train_loss": 2.0 / (e + 1), "val_loss": 2.1 / (e + 1),
                "val_accuracy": 0.3 + 0.2 * e, "samples_per_s": 1000.0 + e} for e in range(3)]
    model = _DictMLP()
    model.train()
    batch = _batch()

    with start_run(tracking_uri, "full", run_name="r1", tags={"team": "ml"}) as run:
        run.log_params({"train": {"lr": 0.05, "epochs": 3}, "model": {"hidden": [32]}})
        for row in history:
            run.log_epoch(row["epoch"], row)
        run.log_metrics({"loss": 0.5}, prefix="final_")
        confusion = np.array([[5, 1, 0], [2, 7, 1], [0, 0, 9]])
        run.log_evaluation({"accuracy": 0.84, "loss": 0.41}, confusion, ["cat", "dog", "eel"])
        run.log_history(history)
        run.log_file(manifest, "shards")
        run.set_tags({"stage": "test"})
        model_uri = run.log_model(model, _features(), {}, "classification", [str(i) for i in range(10)],
                                  _rows(batch[:4]), registered_model_name="tracking-test-mlp")

    assert model.training, "log_model must restore the module's training mode"
    client = MlflowClient(tracking_uri)
    got = client.get_run(run.run_id)
    assert got.info.status == "FINISHED"
    assert got.info.run_name == "r1"
    assert got.info.experiment_id == run.experiment_id
    assert got.data.params["train.lr"] == "0.05" and got.data.params["model.hidden"] == "[32]"
    assert got.data.tags["team"] == "ml" and got.data.tags["stage"] == "test"
    assert got.data.metrics["test_accuracy"] == pytest.approx(0.84)
    assert got.data.metrics["test_loss"] == pytest.approx(0.41)
    assert got.data.metrics["final_loss"] == pytest.approx(0.5)
    assert "epoch" not in got.data.metrics
    for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_s"):
        steps = [(m.step, m.value) for m in client.get_metric_history(run.run_id, key)]
        assert sorted(steps) == [(r["epoch"], pytest.approx(r[key])) for r in history]

    artifacts = _artifact_paths(client, run.run_id)
    assert {"evaluation/confusion_matrix.png", "evaluation/confusion_matrix.json",
            "plots/training_curves.png", "shards/manifest.json"} <= artifacts
    local = Path(client.download_artifacts(run.run_id, "", str(tmp_path / "dl")))
    assert (local / "evaluation/confusion_matrix.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (local / "plots/training_curves.png").read_bytes().startswith(PNG_SIGNATURE)
    saved = json.loads((local / "evaluation/confusion_matrix.json").read_text())
    assert saved == {"class_names": ["cat", "dog", "eel"], "matrix": confusion.tolist()}
    assert json.loads((local / "shards/manifest.json").read_text()) == {"shards": 4}
    # Artifacts of a SQLite store live beside the database, not in the working directory.
    db_dir = Path(tracking_uri[len("sqlite:///"):]).parent
    assert client.get_experiment(run.experiment_id).artifact_location.startswith(db_dir.as_uri())

    # The model: a pyfunc on raw columns, the network in pt2 format, explicit requirements, predicts like
    # the original (a batch of 16, logged with 4: the batch dimension is dynamic).
    loaded = mlflow.pyfunc.load_model(model_uri)
    model.eval()
    with torch.no_grad():
        logits = model({"numeric": torch.from_numpy(batch)})
    predicted = loaded.predict(_rows(batch))
    assert predicted["prediction"].tolist() == logits.argmax(dim=1).tolist()
    np.testing.assert_allclose(np.array(predicted["probability"].tolist()), torch.softmax(logits, 1).numpy(),
                               rtol=1e-5, atol=1e-6)
    logged = mlflow.get_logged_model(model_uri.rsplit("/", 1)[-1])
    assert logged.source_run_id == run.run_id and logged.name == "model"
    model_dir = Path(mlflow.artifacts.download_artifacts(logged.artifact_location, dst_path=str(tmp_path / "m")))
    assert (model_dir / "artifacts" / "shardline" / "model.pt2").is_file()
    requirements = (model_dir / "requirements.txt").read_text().split()
    assert f"torch=={torch.__version__.split('+')[0]}" in requirements
    assert {r.split("==")[0] for r in requirements} >= {"mlflow", "numpy", "pandas", "pyarrow"}
    assert [v.run_id for v in client.search_model_versions("name='tracking-test-mlp'")] == [run.run_id]
    assert mlflow.pyfunc.load_model("models:/tracking-test-mlp/1") is not None


def test_log_model_single_row_example_still_predicts_any_batch(tracking_uri):
    import mlflow.pyfunc

    model = _DictMLP(outputs=1).eval()
    with start_run(tracking_uri, "single-row") as run:  # size-1 dims would be frozen by a naive export
        model_uri = run.log_model(model, _features(), {}, "regression", None, _rows(_batch(1)))
    batch = _batch(5)
    with torch.no_grad():
        expected = model({"numeric": torch.from_numpy(batch)})[:, 0].numpy()
    got = mlflow.pyfunc.load_model(model_uri).predict(_rows(batch))
    assert list(got.columns) == ["prediction"]
    np.testing.assert_allclose(got["prediction"].to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_run_is_failed_when_block_raises(tracking_uri):
    from mlflow import MlflowClient

    with pytest.raises(RuntimeError, match="boom"):
        with start_run(tracking_uri, "failing") as run:
            run.log_epoch(0, {"train_loss": 1.0})
            raise RuntimeError("boom")
    assert MlflowClient(tracking_uri).get_run(run.run_id).info.status == "FAILED"
    # The failed run is no longer active: a new one starts cleanly.
    with start_run(tracking_uri, "failing") as again:
        pass
    assert MlflowClient(tracking_uri).get_run(again.run_id).info.status == "FINISHED"


def test_evaluation_rejects_mismatched_confusion(tracking_uri):
    with start_run(tracking_uri, "bad-eval") as run:
        with pytest.raises(ValueError, match="square"):
            run.log_evaluation({}, np.zeros((2, 3)))
        with pytest.raises(ValueError, match="class_names"):
            run.log_evaluation({}, np.zeros((2, 2)), ["only-one"])


def test_deleted_experiment_is_a_tracking_error(tracking_uri):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(TrackingError, match="'gone'.*deleted"):
        start_run(tracking_uri, "gone")


# --- a real tracking server over HTTP -----------------------------------------------------------

class _Custom(nn.Module):
    """Defined only here: a fresh process cannot import it, so loading must not need the class."""

    def __init__(self):
        super().__init__()
        self.body = _mlp(outputs=1)

    def forward(self, batch):
        return torch.tanh(self.body(batch["numeric"]))


# Runs in a fresh, isolated interpreter (no test or pipeline code importable). It imports while the
# model is logged, then reads the model URI and the batch path from stdin.
_LOAD_IN_FRESH_PROCESS = """
import json, sys
sys.modules["pipeline"] = None  # loading must not need the project package either
import numpy as np, pandas as pd, mlflow.pyfunc
model_uri, batch_path = sys.stdin.read().split()
model = mlflow.pyfunc.load_model(model_uri)
rows = pd.DataFrame(np.load(batch_path).astype(np.float64), columns=[f"x{i:02d}" for i in range(64)])
print(json.dumps(model.predict(rows)["prediction"].tolist()))
"""


@pytest.mark.slow
def test_http_tracking_server_round_trip(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    uri = str(mlflow_server)
    loader_env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true"}
    loader_env.pop("PYTHONPATH", None)
    loader = subprocess.Popen([sys.executable, "-I", "-c", _LOAD_IN_FRESH_PROCESS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=loader_env,
                              cwd=tmp_path)
    try:
        model = _Custom()
        batch = _batch(8)
        with start_run(uri, "over-http", run_name="remote") as run:
            run.log_params({"train": {"lr": 0.1}})
            run.log_epoch(0, {"train_loss": 1.5})
            run.log_epoch(1, {"train_loss": 1.0})
            model_uri = run.log_model(model, _features(), {}, "regression", None, _rows(batch))

        client = MlflowClient(uri)
        got = client.get_run(run.run_id)
        assert got.info.status == "FINISHED" and got.data.params["train.lr"] == "0.1"
        assert [m.step for m in client.get_metric_history(run.run_id, "train_loss")] == [0, 1]
        assert list(mlflow_server.artifacts.rglob("model.pt2")), "artifacts should go through the server"

        np.save(tmp_path / "batch.npy", batch)
        stdout, stderr = loader.communicate(f"{model_uri}\n{tmp_path / 'batch.npy'}\n", timeout=120)
        assert loader.returncode == 0, stderr[-3000:]
        with torch.no_grad():  # regression: the served prediction is the network's first output
            expected = model.eval()({"numeric": torch.from_numpy(batch)})[:, 0].numpy()
        np.testing.assert_allclose(np.array(json.loads(stdout.strip().splitlines()[-1])), expected,
                                   rtol=1e-5, atol=1e-6)
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.communicate()


def test_secrets_in_the_config_are_not_logged_as_params():
    from pipeline.tracking.params import flatten_params

    flat = flatten_params({"data": {"iceberg": {"catalog": {
        "type": "rest", "uri": "postgresql://ml:hunter2@db:5432/catalog", "token": "t0k", "credential": "id:secret",
        "s3.secret-access-key": "abc", "s3.access-key-id": "AKIA1"}}}, "train": {"lr": 0.1}})
    assert flat["data.iceberg.catalog.uri"] == "postgresql://ml:***@db:5432/catalog"
    assert flat["data.iceberg.catalog.token"] == flat["data.iceberg.catalog.credential"] == "***"
    assert flat["data.iceberg.catalog.s3.secret-access-key"] == "***"
    assert flat["data.iceberg.catalog.s3.access-key-id"] == "AKIA1" and flat["train.lr"] == "0.1"
    assert not any(s in v for v in flat.values() for s in ("hunter2", "t0k", "id:secret", "abc"))
