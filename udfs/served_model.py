"""The served shardline model: an MLflow pyfunc "model from code" that predicts from RAW source rows.

Logged by pipeline.tracking.served (TrackedRun.log_model). It is standalone on purpose: a model server
loads it with nothing but mlflow, numpy, pandas, pyarrow, torch (and PIL for images) installed, so it
imports only those and `shardline_transforms`, a copy of udfs/transforms.py shipped in the model's
code_paths — the same raw-columns -> batch implementation the ETL and `shardline score` run, so a served
prediction is computed exactly as a batch-scored one. Never `pipeline` or `udfs`.

The model's `shardline` artifact folder holds:
    features.json      the fitted FeatureSpec dicts, the task, label values and their type, the input
                       columns (name, type, required) and which torch format holds the network
    model.pt2          the network as torch.export's ExportedProgram (dict input, dynamic batch), or
    model.ts           a TorchScript module where export could not capture the model
    vocab/<name>.parquet  one string column `value` per categorical/text feature with a vocabulary

`predict(model_input)` takes a pandas DataFrame of raw columns, named and typed as in the source
(strings for categoricals, bytes for images, numbers for numerics, lists for vectors, strings or token
lists for text) and returns `prediction` (the original label value) and, for classification,
`probability` (softmax, in class-index order). A row the Transform finds invalid (a missing numeric
value that is not imputed, a vector of the wrong length, bytes that are not an image) is refused with
a ValueError naming the columns and counts: a server must not answer with a made-up prediction.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import os

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa

logger = logging.getLogger(__name__)

FORMAT = 1
ARTIFACT = "shardline"          # the model's artifact key: a folder
FEATURES_FILE = "features.json"
EXPORT_FILE = "model.pt2"
SCRIPT_FILE = "model.ts"
VOCAB_DIR = "vocab"
# Rows per forward pass: a large request is scored in slices, so memory stays bounded.
CHUNK_ROWS = 4096

ARROW_TYPES = {
    "double": pa.float64(), "long": pa.int64(), "string": pa.string(), "binary": pa.binary(),
    "boolean": pa.bool_(), "array<double>": pa.list_(pa.float64()), "array<long>": pa.list_(pa.int64()),
    "array<string>": pa.list_(pa.string()),
}


def _missing(value) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def _scalar(value, kind: str):
    """One cell as the Python value of input type `kind` (None for missing). Unconvertible text in a
    numeric column becomes NaN, which the Transform then counts as an invalid value."""
    if _missing(value):
        return None
    if kind == "double":
        try:
            return float(value)
        except (TypeError, ValueError):
            return float("nan")
    if kind == "long":
        return int(value)
    if kind == "boolean":
        return bool(value)
    if kind == "binary":
        if isinstance(value, str):  # JSON carries bytes as base64 (MLflow's own convention)
            return base64.b64decode(value)
        return bytes(value)
    return value if isinstance(value, str) else str(value)


def _cells(values, kind: str):
    if kind.startswith("array<"):
        item = kind[len("array<"):-1]
        return [None if _missing_list(v) else [_scalar(x, item) for x in v] for v in values]
    return [_scalar(v, kind) for v in values]


def _missing_list(value) -> bool:
    return value is None or (not isinstance(value, (list, tuple, np.ndarray)) and _missing(value))


def arrow_column(values, kind: str) -> pa.Array:
    """A pandas column as the Arrow array of input type `kind`. Numbers and strings take the vectorized
    route; bytes, lists and mixed object columns go cell by cell (a request is small)."""
    target = ARROW_TYPES[kind]
    if kind == "double":
        numbers = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        return pa.array(numbers, pa.float64())
    if isinstance(values, pd.Series) and values.dtype.kind in "iu" and kind == "long":
        return pa.array(values.to_numpy(), pa.int64())
    return pa.array(_cells(list(values), kind), target)


def read_vocabularies(folder: str, specs) -> dict:
    import pyarrow.parquet as pq

    out = {}
    for spec in specs:
        path = os.path.join(folder, VOCAB_DIR, f"{spec['name']}.parquet")
        if spec["type"] in ("categorical", "text") and not spec.get("hash_buckets"):
            out[spec["name"]] = pq.read_table(path, columns=["value"]).column("value").combine_chunks()
    return out


class ShardlineServedModel(mlflow.pyfunc.PythonModel):
    """Raw rows -> shardline_transforms.Transform -> the torch network -> label values."""

    def load_context(self, context):
        import torch
        # Importable only once MLflow has put the model's code_paths on sys.path (at load, not at log).
        from shardline_transforms import Transform

        folder = context.artifacts[ARTIFACT]
        with open(os.path.join(folder, FEATURES_FILE)) as fh:
            info = json.load(fh)
        if info.get("format") != FORMAT:
            raise ValueError(f"{folder}/{FEATURES_FILE} has format {info.get('format')}, this model reads {FORMAT}")
        self.info = info
        self.inputs = info["inputs"]
        self.task = info["task"]
        labels = info.get("labels")
        self.labels = None if labels is None else \
            [int(v) for v in labels] if info.get("label_type") == "long" else [str(v) for v in labels]
        self.transform = Transform(info["features"], read_vocabularies(folder, info["features"]))
        if info["torch_format"] == "torch.export":
            self.network = torch.export.load(os.path.join(folder, EXPORT_FILE)).module()
        else:
            self.network = torch.jit.load(os.path.join(folder, SCRIPT_FILE), map_location="cpu")
            self.network.eval()

    def table(self, frame: pd.DataFrame) -> pa.Table:
        missing = [c["name"] for c in self.inputs if c["required"] and c["name"] not in frame.columns]
        if missing:
            raise ValueError(f"the input lacks column(s) {missing}; this model reads "
                             f"{[c['name'] for c in self.inputs]} (raw source columns)")
        arrays = {}
        for column in self.inputs:
            name, kind = column["name"], column["type"]
            if name in frame.columns:
                arrays[name] = arrow_column(frame[name], kind)
            else:  # an optional column left out: every value missing (imputed / null id)
                arrays[name] = pa.nulls(len(frame), ARROW_TYPES[kind])
        return pa.table(arrays) if arrays else pa.table({"_": pa.nulls(len(frame))})

    # The pd.DataFrame hint is one MLflow takes without inferring a signature from it (a DataFrame hint says
    # nothing of the columns): the explicit signature log_served_model passes stays the model's, and
    # MLflow's schema enforcement on it is what refuses a missing column or a column of the wrong type
    # before predict runs. Without a hint MLflow warns at every log and load ("Add type hints ...").
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        import torch

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        arrays, valid, counts, image_error = self.transform.apply(self.table(frame))
        if not valid.all():
            bad = int((~valid).sum())
            detail = f"; first image error: {image_error}" if image_error else ""
            raise ValueError(f"{bad} of {len(valid)} input rows are invalid (invalid values per column: {counts})"
                             f"{detail}: a numeric feature needs a finite number unless it is imputed, a vector "
                             "feature its configured length of finite numbers, an image feature decodable bytes")
        outputs = []
        with torch.inference_mode():
            for start in range(0, len(valid), CHUNK_ROWS):
                batch = {k: torch.from_numpy(np.ascontiguousarray(v[start:start + CHUNK_ROWS]))
                         for k, v in arrays.items()}
                outputs.append(self.network(batch).to(torch.float64))
        width = len(self.labels) if self.task == "classification" else 1
        out = torch.cat(outputs) if outputs else torch.zeros((0, width), dtype=torch.float64)
        if self.task != "classification":
            if out.dim() > 1 and out.shape[1] != 1:
                raise ValueError(f"a regression network must have one output, this one has {out.shape[1]}")
            return pd.DataFrame({"prediction": out.reshape(-1).numpy()})
        probabilities = torch.softmax(out, dim=1).numpy()
        index = probabilities.argmax(axis=1)
        prediction = pd.Series([self.labels[i] for i in index],
                               dtype="int64" if self.info.get("label_type") == "long" else object)
        return pd.DataFrame({"prediction": prediction, "probability": [row.tolist() for row in probabilities]})


mlflow.models.set_model(ShardlineServedModel())
