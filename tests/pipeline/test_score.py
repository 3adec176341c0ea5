"""Batch scoring: models:/NAME@champion -> Arrow UDF predictions on raw rows, equal to local torch ones; typed
features (numeric, imputed numeric, categorical, image, vector) scored through the Transform from a run's
artifacts, invalid rows counted per column, a column of the wrong type named."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import steps
from pipeline.config import load
from pipeline.errors import DataError, ShardlineError
from pipeline.score import score
from pipeline.models.trust import seal_model

NAME = "digits-score"
ROWS = 120
BAD = {3: ("pixel_10", float("nan")), 17: ("pixel_20", None), 40: ("pixel_33", float("inf"))}


def _cfg(conf_dir, work, *extra):
    return load(f"{conf_dir}/digits.yaml", [f"workdir={work}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                                            f"tracking.registered_model={NAME}", "train.epochs=2",
                                            "model.hidden=[32]", "score.keep_columns=[image_id]", *extra])


def _log_served_model(cfg, run_id: str, raw_rows) -> str:
    """The served model of the trained run, logged through TrackedRun.log_model from raw rows."""
    from pipeline.models import build_model, load_flat_parameters
    from pipeline.tracking import start_run

    manifest = steps.load_shards(cfg)
    spec, parameters, _ = steps.load_saved_model(cfg)
    model = build_model(spec)
    load_flat_parameters(model, parameters)
    with start_run(steps.tracking_uri(cfg), cfg.tracking.experiment, run_id=run_id) as run:
        return run.log_model(model, manifest.feature_set, manifest.vocabulary_files(), manifest.task,
                             list(manifest.label_mapping), raw_rows)


@pytest.fixture(scope="module")
def trained(spark, tmp_path_factory, conf_dir):
    work = tmp_path_factory.mktemp("score")
    cfg = _cfg(conf_dir, work)
    # The model is logged here rather than by run_all, so this test does not depend on how steps logs it.
    outcome = steps.run_all(spark, _cfg(conf_dir, work, "tracking.log_model=false"))
    raw_digits = pq.read_table(os.path.join(work, "raw", "digits"))
    model_uri = _log_served_model(cfg, outcome.run_id, raw_digits.slice(0, 5).to_pandas())
    promotion = steps.promote(spark, cfg, run_id=outcome.run_id, model_uri=model_uri)
    assert promotion.alias == "champion"
    # Raw digits rows (original, unstandardized columns), a few with a null/NaN/inf feature.
    table = raw_digits.slice(0, ROWS)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    for row, (column, value) in BAD.items():
        columns[column][row] = value
    raw = pa.table({k: pa.array(v, table.schema.field(k).type) for k, v in columns.items()})
    path = work / "input.parquet"
    pq.write_table(raw, path)
    return work, cfg, path, raw, promotion


def _local_predictions(cfg, raw: pa.Table):
    """The same model scored in-process on the same rows, standardized with the manifest's statistics."""
    import torch

    from pipeline.models import build_model, load_flat_parameters

    manifest = steps.load_shards(cfg)
    spec, parameters, _ = steps.load_saved_model(cfg)
    model = build_model(spec)
    load_flat_parameters(model, parameters)
    model.eval()
    x = np.column_stack([raw.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
                         for c in manifest.feature_columns])
    valid = np.isfinite(x).all(axis=1)
    z = ((x[valid] - np.asarray(manifest.means)) * (1.0 / np.asarray(manifest.stds))).astype(np.float32)
    with torch.no_grad():
        out = model(torch.from_numpy(z))
    labels = np.asarray([int(v) for v in manifest.label_mapping])
    ids = raw.column("image_id").to_numpy()[valid]
    return ids, labels[out.argmax(dim=1).numpy()], torch.softmax(out, dim=1).numpy()


def _no_staging_left(folder):
    return [p for p in os.listdir(folder) if p.startswith(".") and ("staging" in p or "replaced" in p)] == []


@pytest.mark.slow
def test_champion_scores_like_local_torch_and_drops_invalid_rows(spark, trained, tmp_path, conf_dir):
    work, cfg, path, raw, promotion = trained
    output = str(tmp_path / "predictions")
    result = score(spark, cfg, f"models:/{NAME}@champion", str(path), output)
    assert result.input_rows == ROWS and result.invalid_rows == len(BAD)
    assert result.scored_rows == result.written_rows == ROWS - len(BAD)
    assert result.invalid_by_column == {"pixel_10": 1, "pixel_20": 1, "pixel_33": 1}
    assert result.rows_per_s > 0
    written = pq.read_table(output).sort_by("image_id")
    assert written.column_names == ["image_id", "prediction", "probability"]
    assert written.schema.field("prediction").type == pa.int64()
    ids, predictions, probabilities = _local_predictions(cfg, raw)
    assert written.column("image_id").to_pylist() == sorted(ids.tolist())
    order = np.argsort(ids)
    np.testing.assert_array_equal(written.column("prediction").to_numpy(), predictions[order])
    got = np.asarray(written.column("probability").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(got, probabilities[order], rtol=1e-5, atol=1e-6)
    assert _no_staging_left(tmp_path)

    with pytest.raises(ShardlineError, match="exists"):  # an existing output is never replaced silently
        score(spark, cfg, f"models:/{NAME}@champion", str(path), output)
    again = score(spark, _cfg(conf_dir, work, "score.overwrite=true",
                              "score.probabilities=false"),
                  f"models:/{NAME}/{promotion.version}", str(path), output)
    assert again.scored_rows == ROWS - len(BAD)
    assert pq.read_table(output).column_names == ["image_id", "prediction"]
    assert _no_staging_left(tmp_path)


@pytest.mark.slow
def test_keep_null_writes_every_row_with_null_predictions_for_invalid_ones(spark, trained, tmp_path, conf_dir):
    work, _, path, raw, _ = trained
    cfg = _cfg(conf_dir, work, "score.invalid_rows=keep_null", "score.log_to_mlflow=true")
    output = str(tmp_path / "kept")
    result = score(spark, cfg, f"models:/{NAME}@champion", str(path), output)
    assert (result.input_rows, result.scored_rows, result.invalid_rows, result.written_rows) == \
        (ROWS, ROWS - len(BAD), len(BAD), ROWS)
    written = pq.read_table(output).sort_by("image_id")
    assert written.num_rows == ROWS
    null_ids = [i for i, p in zip(written.column("image_id").to_pylist(), written.column("prediction").to_pylist())
                if p is None]
    assert null_ids == sorted(raw.column("image_id").to_numpy()[list(BAD)].tolist())
    assert written.column("probability").null_count == len(BAD)
    ids, predictions, _ = _local_predictions(cfg, raw)
    scored = written.filter(pa.compute.is_valid(written.column("prediction")))
    np.testing.assert_array_equal(scored.column("prediction").to_numpy(), predictions[np.argsort(ids)])

    from mlflow import MlflowClient

    run = MlflowClient(steps.tracking_uri(cfg)).get_run(result.mlflow_run_id)
    assert run.data.metrics["score_invalid_rows"] == len(BAD)
    assert run.data.metrics["score_scored_rows"] == ROWS - len(BAD)


@pytest.mark.slow
def test_reject_fails_before_writing_and_missing_columns_are_named(spark, trained, tmp_path, conf_dir):
    work, _, path, raw, _ = trained
    cfg = _cfg(conf_dir, work, "score.invalid_rows=reject")
    output = str(tmp_path / "rejected")
    with pytest.raises(DataError, match=r"3 rows .*pixel_10"):
        score(spark, cfg, f"models:/{NAME}@champion", str(path), output)
    assert not os.path.exists(output) and _no_staging_left(tmp_path)

    partial = tmp_path / "partial.parquet"
    pq.write_table(raw.drop_columns(["pixel_05", "pixel_63"]), partial)
    with pytest.raises(DataError, match=r"pixel_05.*pixel_63"):
        score(spark, _cfg(conf_dir, work), f"models:/{NAME}@champion", str(partial), output)
    with pytest.raises(ShardlineError, match="challenger|alias|cannot resolve"):
        score(spark, _cfg(conf_dir, work), f"models:/{NAME}@challenger", str(path), output)
    assert not os.path.exists(output)


# --- typed features, from a run's artifacts -------------------------------------------------------------

TYPED_LABELS = ["0", "1"]
CITIES = ["paris", "rome", "oslo"]


def _typed_features():
    from pipeline.config.feature_spec import FeatureSet, FeatureSpec

    return FeatureSet((
        FeatureSpec("age", "numeric", standardize=True, mean=40.0, std=10.0, source_type="double"),
        FeatureSpec("income", "numeric", impute="median", fill=3.0, missing_flag=True, source_type="double"),
        FeatureSpec("city", "categorical", vocab_size=len(CITIES), vocabulary="vocab/city.parquet",
                    source_type="string"),
        FeatureSpec("photo", "image", height=4, width=4, channels=1, source_type="binary"),
        FeatureSpec("emb", "vector", length=2, source_type="array<double>"),
    ))


def _png(seed: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (5, 5), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


# row -> (column, bad value): each row is invalid for exactly one feature (income is imputed: never invalid)
TYPED_BAD = {2: ("age", None), 5: ("photo", b"\x89PNG broken"), 9: ("emb", [1.0]), 11: ("age", float("nan"))}
TYPED_ROWS = 40


def _typed_input() -> pa.Table:
    rng = np.random.default_rng(11)
    columns = {
        "key": list(range(TYPED_ROWS)),
        "age": rng.normal(40, 10, TYPED_ROWS).tolist(),
        "income": [None if i % 7 == 0 else float(v) for i, v in enumerate(rng.normal(3, 1, TYPED_ROWS))],
        "city": [(CITIES + ["atlantis", None])[i % 5] for i in range(TYPED_ROWS)],
        "photo": [_png(i) for i in range(TYPED_ROWS)],
        "emb": [rng.normal(size=2).tolist() for _ in range(TYPED_ROWS)],
    }
    for row, (column, value) in TYPED_BAD.items():
        columns[column][row] = value
    types = {"key": pa.int64(), "age": pa.float64(), "income": pa.float64(), "city": pa.string(),
             "photo": pa.binary(), "emb": pa.list_(pa.float64())}
    return pa.table({k: pa.array(v, types[k]) for k, v in columns.items()})


@pytest.fixture(scope="module")
def typed_run(tmp_path_factory):
    """A tracked run with what shardline logs for scoring: shardline/model.pt, data/manifest.json and
    data/vocab/city.parquet (TrackedRun.log_manifest)."""
    import torch

    from pipeline.models import ModelSpec, build_model, flat_parameters
    from pipeline.shards.manifest import Manifest
    from pipeline.tracking import start_run

    root = tmp_path_factory.mktemp("typed-score")
    features = _typed_features()
    shards = root / "shards"
    (shards / "vocab").mkdir(parents=True)
    pq.write_table(pa.table({"value": CITIES}), shards / "vocab" / "city.parquet")
    manifest = Manifest(name="typed", task="classification", feature_columns=tuple(features.numeric_columns),
                        label_column="label", label_mapping=tuple(TYPED_LABELS), standardized=True,
                        means=(40.0, 0.0), stds=(10.0, 1.0), splits={}, fingerprint="sha256:" + "1" * 64,
                        features=tuple(features.to_list()), root=str(shards))
    manifest.write(shards)
    torch.manual_seed(5)
    spec = ModelSpec(kind="mlp", num_features=features.numeric_width, num_outputs=2, task="classification",
                     hidden=(8,), features=tuple(features.to_list()))
    model = build_model(spec).eval()
    torch.save(seal_model(spec.to_dict(), flat_parameters(model)), root / "model.pt")
    uri = f"sqlite:///{root}/mlflow.db"
    with start_run(uri, "typed-score") as run:
        run.log_manifest(manifest)
        run.log_file(root / "model.pt", "shardline")
    source = root / "typed.parquet"
    pq.write_table(_typed_input(), source)
    return root, uri, run.run_id, model, manifest, source


def _typed_cfg(root, uri, *extra):
    return load(None, [f"workdir={root}/work", f"tracking.uri={uri}", "score.keep_columns=[key]", *extra])


def _typed_expected(model, manifest, table: pa.Table):
    import torch

    from udfs.transforms import Transform, take_rows

    arrays, valid, counts, _ = Transform(manifest.feature_set.to_list(), manifest.vocabularies()).apply(table)
    with torch.no_grad():
        logits = model({k: torch.from_numpy(v) for k, v in take_rows(arrays, valid).items()})
    keys = np.asarray(table.column("key").to_pylist())[valid]
    return keys, logits.argmax(dim=1).numpy(), torch.softmax(logits, dim=1).numpy(), counts


def test_typed_features_score_through_the_transform_and_count_invalid_rows(spark, typed_run, tmp_path):
    root, uri, run_id, model, manifest, source = typed_run
    keys, classes, probabilities, counts = _typed_expected(model, manifest, _typed_input())
    assert counts == {"age": 2, "photo": 1, "emb": 1}  # the Transform's own account of TYPED_BAD

    dropped = score(spark, _typed_cfg(root, uri), f"runs:/{run_id}", str(source), str(tmp_path / "drop"))
    assert (dropped.input_rows, dropped.invalid_rows, dropped.scored_rows) == \
        (TYPED_ROWS, len(TYPED_BAD), TYPED_ROWS - len(TYPED_BAD))
    assert dropped.invalid_by_column == counts
    written = pq.read_table(tmp_path / "drop").sort_by("key")
    assert written.schema.field("prediction").type == pa.int64()  # "0"/"1" labels come back as integers
    assert written.column("key").to_pylist() == sorted(keys.tolist())
    np.testing.assert_array_equal(written.column("prediction").to_numpy(), classes[np.argsort(keys)])
    np.testing.assert_allclose(np.asarray(written.column("probability").to_pylist()),
                               probabilities[np.argsort(keys)], rtol=1e-5, atol=1e-6)

    kept = score(spark, _typed_cfg(root, uri, "score.invalid_rows=keep_null"), f"runs:/{run_id}", str(source),
                 str(tmp_path / "keep"))
    assert kept.written_rows == TYPED_ROWS and kept.invalid_by_column == counts
    table = pq.read_table(tmp_path / "keep").sort_by("key")
    nulls = [k for k, p in zip(table.column("key").to_pylist(), table.column("prediction").to_pylist()) if p is None]
    assert nulls == sorted(TYPED_BAD)

    with pytest.raises(DataError, match=r"reject: 4 rows .*'age': 2"):  # the Transform's pre-pass
        score(spark, _typed_cfg(root, uri, "score.invalid_rows=reject"), f"runs:/{run_id}", str(source),
              str(tmp_path / "reject"))
    assert not os.path.exists(tmp_path / "reject")


def test_a_feature_column_of_the_wrong_type_is_named(spark, typed_run, tmp_path):
    root, uri, run_id, _, _, _ = typed_run
    table = _typed_input()
    for column, value, needs in (("city", pa.array([1.5] * TYPED_ROWS), "a string or integer column"),
                                 ("photo", pa.array(["x.png"] * TYPED_ROWS), r"encoded image bytes \(binary\)"),
                                 ("emb", pa.array(["1,2"] * TYPED_ROWS), "a Spark ML Vector or an array of 2")):
        path = tmp_path / f"wrong-{column}.parquet"
        pq.write_table(table.set_column(table.column_names.index(column), column, value), path)
        with pytest.raises(DataError, match=rf"feature column '{column}' .* has type \w+; the \w+ feature "
                                            rf"'{column}' needs {needs}"):
            score(spark, _typed_cfg(root, uri), f"runs:/{run_id}", str(path), str(tmp_path / "out"))


@pytest.mark.parametrize("tamper", ["factory", "flipped"])
def test_a_tampered_model_artifact_is_refused_before_any_code_is_imported(spark, typed_run, tmp_path, tamper):
    import torch

    from pipeline.models.trust import ArtifactTrustError
    from pipeline.tracking import start_run

    root, uri, run_id, _, manifest, source = typed_run
    state = torch.load(root / "model.pt", weights_only=True)
    if tamper == "factory":
        state["spec"] = {**state["spec"], "kind": "factory", "factory": "os:system"}
    else:
        state["parameters"][1] += 1.0
    path = tmp_path / "model.pt"
    torch.save(state, path)
    with start_run(uri, "typed-score-tampered") as run:
        run.log_manifest(manifest)
        run.log_file(path, "shardline")
    match = "names model.factory 'os:system'" if tamper == "factory" else "does not match its sha256 digest"
    with pytest.raises(ArtifactTrustError, match=match):
        score(spark, _typed_cfg(root, uri), f"runs:/{run.run_id}", str(source), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
