"""Batch scoring: models:/NAME@champion -> Arrow UDF predictions on raw rows, equal to local torch ones."""
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

NAME = "digits-score"
ROWS = 120
BAD = {3: ("pixel_10", float("nan")), 17: ("pixel_20", None), 40: ("pixel_33", float("inf"))}


def _cfg(conf_dir, work, *extra):
    return load(f"{conf_dir}/digits.yaml", [f"workdir={work}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                                            f"tracking.registered_model={NAME}", "train.epochs=2",
                                            "model.hidden=[32]", "score.keep_columns=[image_id]", *extra])


@pytest.fixture(scope="module")
def trained(spark, tmp_path_factory, conf_dir):
    work = tmp_path_factory.mktemp("score")
    cfg = _cfg(conf_dir, work)
    outcome = steps.run_all(spark, cfg)
    promotion = steps.promote(spark, cfg, run_id=outcome.run_id, model_uri=outcome.model_uri)
    assert promotion.alias == "champion"
    # Raw digits rows (original, unstandardized columns), a few with a null/NaN/inf feature.
    table = pq.read_table(os.path.join(work, "raw", "digits")).slice(0, ROWS)
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
