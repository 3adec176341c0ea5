"""The served MLflow model: a pyfunc "model from code" (udfs/served_model.py) that takes RAW source rows.

What goes into it: the network (torch.export with the batch dict and a dynamic batch dimension, or
TorchScript where export cannot capture it), `features.json` (the FeatureSpec dicts, the task, the label
values and their type, the raw input columns) and the vocabulary files, all under the model's `shardline`
artifact folder; udfs/transforms.py rides along in code_paths as `shardline_transforms`, so the server
preprocesses with the very code the ETL and `shardline score` run. The signature names the raw columns
with MLflow types (binary for images, string, long/double, array<double> for vectors).

`input_example(raw_rows, features)` turns a few raw source rows (e.g. `df.limit(5).toPandas()`, Spark
Vectors and bytearrays included) into the example the model is logged with.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from pipeline.config.feature_spec import FeatureSet, FeatureSpec
from pipeline.errors import ShardlineError

logger = logging.getLogger(__name__)

MODEL_NAME = "model"
EXAMPLE_ROWS = 5  # the valid rows the model is logged (and its network traced) with
# The served model's layout; udfs/served_model.py spells the same names (it may not import this module).
FORMAT = 1
ARTIFACT = "shardline"
FEATURES_FILE = "features.json"
EXPORT_FILE = "model.pt2"
SCRIPT_FILE = "model.ts"
VOCAB_DIR = "vocab"
TRANSFORMS_MODULE = "shardline_transforms"
# What the served model imports; pinned to this process's versions so a server builds the same stack.
REQUIREMENTS = ("mlflow", "torch", "numpy", "pandas", "pyarrow", "pillow")

_INTEGRAL = ("tinyint", "smallint", "int", "bigint", "long", "integer", "short", "byte")
_FLOATING = ("float", "double", "real")


class ServedModelError(ShardlineError):
    """The model cannot be logged as a served model; the message says which part failed and why."""


def _element(source_type: str) -> str:
    inner = source_type[len("array<"):-1] if source_type.startswith("array<") else ""
    return "long" if inner in _INTEGRAL else "string" if inner == "string" else "double"


def input_column(spec: FeatureSpec) -> dict[str, Any]:
    """The served model's raw input column of one feature: {name, type, required} with an MLflow type
    (double, long, string, boolean, binary, array<double|long|string>), from the source's Spark type."""
    source = (spec.source_type or "").lower()
    required = True
    if spec.type == "numeric":
        # An integer source stays long, unless it is imputed: a missing value needs a float (NaN).
        kind = "long" if source in _INTEGRAL and not spec.impute else "double"
    elif spec.type == "categorical":
        kind = "long" if source in _INTEGRAL else "boolean" if source == "boolean" else \
            "double" if source in _FLOATING or source.startswith("decimal") else "string"
    elif spec.type == "vector":
        kind = "array<double>"
    elif spec.type == "image":
        kind = "string" if spec.source == "path" else "binary"
    elif spec.type == "text":
        kind = "string" if spec.tokenize else f"array<{_element(source) if source else 'long'}>"
        # A null token list is a valid (empty) text, and MLflow refuses null lists in a required column.
        required = spec.tokenize
    else:
        raise ServedModelError(f"feature {spec.name!r} has type {spec.type!r}, which the served model cannot read")
    return {"name": spec.name, "type": kind, "required": required}


def input_columns(features: FeatureSet) -> list[dict[str, Any]]:
    return [input_column(spec) for spec in features]


def label_type(label_values: Optional[Sequence[str]]) -> Optional[str]:
    """'long' when every label value is an integer written plainly (numeric labels), else 'string'."""
    if label_values is None:
        return None
    try:
        if all(str(int(v)) == str(v) for v in label_values):
            return "long"
    except ValueError:
        pass
    return "string"


def _mlflow_type(kind: str):
    from mlflow.types import DataType
    from mlflow.types.schema import Array

    if kind.startswith("array<"):
        return Array(getattr(DataType, kind[len("array<"):-1]))
    return getattr(DataType, kind)


def signature(inputs: Sequence[Mapping[str, Any]], task: str, labels_as: Optional[str]):
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import Array, ColSpec, Schema

    schema = Schema([ColSpec(_mlflow_type(c["type"]), c["name"], required=c["required"]) for c in inputs])
    if task == "classification":
        outputs = Schema([ColSpec(_mlflow_type(labels_as or "string"), "prediction"),
                          ColSpec(Array(DataType.double), "probability")])
    else:
        outputs = Schema([ColSpec(DataType.double, "prediction")])
    return ModelSignature(inputs=schema, outputs=outputs)


def _cell(value, kind: str):
    """One raw value as the plain Python value MLflow's schema check takes for `kind`."""
    import pandas as pd

    if kind.startswith("array<"):
        if value is None or (not hasattr(value, "__len__") and pd.isna(value)):
            return None
        if hasattr(value, "toArray"):  # a Spark ML Vector
            value = value.toArray()
        item = kind[len("array<"):-1]
        cast = float if item == "double" else int if item == "long" else str
        return [cast(v) for v in value]
    if value is None or (not isinstance(value, (bytes, bytearray, memoryview, str)) and pd.isna(value)):
        return None
    if kind == "binary":
        return bytes(value)
    return {"double": float, "long": int, "boolean": bool}.get(kind, str)(value)


def input_example(raw_rows, features: FeatureSet, rows: int = 5):
    """A pandas DataFrame of up to `rows` raw source rows in the served model's input form: the feature
    columns only, in feature order, each value a plain Python value of its input type. `raw_rows` is a
    pandas DataFrame of source rows (Spark's toPandas() output is fine: Vectors, bytearrays, numpy
    arrays). Rows a long column cannot hold (a null in an integer column) are left out."""
    import pandas as pd

    columns = input_columns(features)
    missing = [c["name"] for c in columns if c["name"] not in raw_rows.columns]
    if missing:
        raise ServedModelError(f"the raw rows lack the feature column(s) {missing} (they have "
                               f"{list(raw_rows.columns)})")
    data = {c["name"]: [_cell(v, c["type"]) for v in raw_rows[c["name"]]] for c in columns}
    frame = pd.DataFrame(data, index=range(len(raw_rows)), dtype=object)
    longs = [c["name"] for c in columns if c["type"] == "long"]
    if longs:
        frame = frame[frame[longs].notna().all(axis=1)]
    for column in columns:
        if column["type"] == "double":
            frame[column["name"]] = frame[column["name"]].astype("float64")
        elif column["type"] == "long":
            frame[column["name"]] = frame[column["name"]].astype("int64")
    return frame.head(rows).reset_index(drop=True)


def requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in REQUIREMENTS:
        try:
            pins.append(f"{name}=={version(name).split('+')[0]}")  # torch's local "+cpu" is no PyPI version
        except PackageNotFoundError:
            if name != "pillow":  # only image features need it
                raise
    return pins


def _read_vocabularies(vocabulary_files: Mapping[str, str]) -> dict:
    import pyarrow.parquet as pq

    out = {}
    for name, path in vocabulary_files.items():
        try:
            out[name] = pq.read_table(path, columns=["value"]).column("value").combine_chunks()
        except (OSError, KeyError) as exc:
            raise ServedModelError(f"cannot read the vocabulary of feature {name!r} at {path}: {exc}") from None
    return out


def _arrow_type(kind: str):
    import pyarrow as pa

    scalar = {"double": pa.float64(), "long": pa.int64(), "string": pa.string(), "binary": pa.binary(),
              "boolean": pa.bool_()}
    return pa.list_(scalar[kind[len("array<"):-1]]) if kind.startswith("array<") else scalar[kind]


def _example_batch(frame, features: FeatureSet, vocabularies: Mapping[str, Any]):
    """(the valid example rows, their batch arrays): the rows the network is traced on and MLflow
    checks the logged model with; an invalid row would make that check fail."""
    import pyarrow as pa

    from udfs.transforms import Transform, take_rows

    table = pa.table({c["name"]: pa.array(frame[c["name"]].tolist(), _arrow_type(c["type"]))
                      for c in input_columns(features)})
    arrays, valid, counts, error = Transform(features.to_list(), vocabularies).apply(table)
    if not valid.any():
        raise ServedModelError(f"none of the {len(frame)} input example rows is valid (invalid values per "
                               f"column: {counts}{'; ' + error if error else ''}); pass rows the model can score")
    if not valid.all():
        logger.warning("leaving %d invalid rows out of the input example (%s)", int((~valid).sum()), counts)
    return frame[valid].reset_index(drop=True), take_rows(arrays, valid)


def _tensors(arrays: Mapping[str, np.ndarray]):
    import torch

    # torch.export specializes a size-1 (or 0) dimension: trace on at least two rows.
    rows = len(next(iter(arrays.values())))
    repeat = max(1, -(-2 // max(rows, 1)))
    return {k: torch.from_numpy(np.ascontiguousarray(np.concatenate([v] * repeat) if repeat > 1 else v))
            for k, v in arrays.items()}


def export_network(model, arrays: Mapping[str, np.ndarray], folder: Path) -> str:
    """Save `model` (eval mode, CPU) under `folder` as torch.export's program (model.pt2) or, where export
    cannot capture it, TorchScript (model.ts); return the format. The saved network must reproduce the
    eager outputs on the example, else this raises."""
    import torch

    tensors = _tensors(arrays)
    with torch.no_grad():
        expected = model(tensors)
    reasons = []
    # A refused export logs the half-traced graph at WARNING; the reason we report is enough.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        batch = torch.export.Dim("batch")
        program = torch.export.export(model, (tensors,), dynamic_shapes=({k: {0: batch} for k in tensors},),
                                      strict=False)
        torch.export.save(program, str(folder / EXPORT_FILE))
        saved, fmt = torch.export.load(str(folder / EXPORT_FILE)).module(), "torch.export"
    except Exception as exc:  # export raises many types (guards, unsupported ops, pytrees)
        reasons.append(f"torch.export: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        (folder / EXPORT_FILE).unlink(missing_ok=True)
        try:
            # Scripting, unlike tracing, keeps data-dependent branches: what usually defeats export.
            torch.jit.save(torch.jit.script(model), str(folder / SCRIPT_FILE))
            saved, fmt = torch.jit.load(str(folder / SCRIPT_FILE), map_location="cpu"), "torchscript"
        except Exception as script_exc:
            reasons.append(f"torch.jit.script: {type(script_exc).__name__}: {script_exc}".splitlines()[0])
            raise ServedModelError(
                "the model can be saved neither with torch.export nor as TorchScript (" + "; ".join(reasons) +
                "); make its forward export-friendly (no Python branches on tensor values) or scriptable "
                "(annotate the batch as Dict[str, Tensor])") from None
        logger.warning("the served model uses TorchScript: %s", reasons[0])
    finally:
        shapes_log.setLevel(level)
    with torch.no_grad():
        got = saved(tensors)
    if not torch.allclose(got.to(torch.float64), expected.to(torch.float64), rtol=1e-4, atol=1e-5):
        raise ServedModelError(f"the {fmt} network disagrees with the model on the input example (max "
                               f"difference {float((got - expected).abs().max()):.3g})")
    return fmt


def _transforms_source() -> str:
    import udfs.transforms

    return udfs.transforms.__file__


def _served_model_source() -> str:
    from importlib.util import find_spec

    return find_spec("udfs.served_model").origin  # not imported: it calls mlflow.models.set_model


def log_served_model(run_id: str, tracking_uri: str, model, features: FeatureSet,
                     vocabulary_files: Mapping[str, str], task: str, label_values: Optional[Sequence[str]],
                     input_example_rows, registered_model_name: Optional[str] = None) -> str:
    """Log the served pyfunc model as run `run_id`'s `model`; return its model URI (see TrackedRun.log_model).
    `input_example_rows` may hold invalid rows (left out) and more than EXAMPLE_ROWS rows (the first valid
    EXAMPLE_ROWS are kept)."""
    import mlflow
    import mlflow.pyfunc
    import torch
    from mlflow.models import Model

    if task == "classification" and not label_values:
        raise ServedModelError("a classification model needs its label values (class-index order)")
    wanted = [f.name for f in features if f.type in ("categorical", "text") and not f.hash_buckets]
    absent = [n for n in wanted if n not in vocabulary_files]
    if absent:
        raise ServedModelError(f"no vocabulary file for feature(s) {absent}; pass Manifest.vocabulary_files()")
    unnamable = [n for n in wanted if os.sep in n or n in (".", "..")]
    if unnamable:
        raise ServedModelError(f"feature name(s) {unnamable} cannot name a vocabulary file")
    vocabularies = _read_vocabularies({n: vocabulary_files[n] for n in wanted})
    example = input_example(input_example_rows, features, rows=len(input_example_rows))
    example, arrays = _example_batch(example, features, vocabularies)
    example, arrays = example.head(EXAMPLE_ROWS), {k: v[:EXAMPLE_ROWS] for k, v in arrays.items()}
    inputs = input_columns(features)
    labels_as = label_type(label_values) if task == "classification" else None

    on_cpu = all(t.device.type == "cpu" for t in model.state_dict().values())
    network = model if on_cpu else copy.deepcopy(model).cpu()
    modes = {module: module.training for module in model.modules()}
    network.eval()
    with tempfile.TemporaryDirectory(prefix="shardline-served-") as tmp:
        folder = Path(tmp) / ARTIFACT
        (folder / VOCAB_DIR).mkdir(parents=True)
        try:
            fmt = export_network(network, arrays, folder)
        finally:
            for module, training in modes.items():  # per module: frozen submodules stay in eval
                module.training = training
        for name in wanted:
            shutil.copyfile(vocabulary_files[name], folder / VOCAB_DIR / f"{name}.parquet")
        layout = {"format": FORMAT, "features": features.to_list(), "task": task,
                "labels": None if label_values is None else [str(v) for v in label_values],
                "label_type": labels_as, "inputs": inputs, "torch_format": fmt,
                "batch_keys": features.batch_keys(), "torch_version": torch.__version__}
        (folder / FEATURES_FILE).write_text(json.dumps(layout, indent=1))
        code = Path(tmp) / "code"
        code.mkdir()
        shutil.copyfile(_transforms_source(), code / f"{TRANSFORMS_MODULE}.py")
        mlflow.set_tracking_uri(tracking_uri)  # Model.log resolves the store from the global URI
        info = Model.log(
            artifact_path=None, name=MODEL_NAME, flavor=mlflow.pyfunc,
            run_id=run_id,  # no reliance on this thread's active run
            python_model=_served_model_source(), artifacts={ARTIFACT: str(folder)},
            code_paths=[str(code / f"{TRANSFORMS_MODULE}.py")],
            signature=signature(inputs, task, labels_as), input_example=example,
            pip_requirements=requirements(), registered_model_name=registered_model_name)
    logger.info("logged served model %s (%s, %d features) for run %s", info.model_uri, fmt, len(features), run_id)
    return info.model_uri
