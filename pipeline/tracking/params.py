"""Flatten a nested config into MLflow params."""
from __future__ import annotations

import json
from collections.abc import Mapping

from pipeline.config.sources import is_secret, without_password

# mlflow.utils.validation.MAX_PARAM_VAL_LENGTH (kept here so flattening needs no mlflow import).
MAX_PARAM_VALUE_LENGTH = 6000
_TRUNCATED = "..."


def _render(value: object) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else list(value)
        return json.dumps(items, separators=(",", ":"), default=str)
    return str(value)


def flatten_params(cfg: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 0.05}}`` -> ``{"train.lr": "0.05"}``.

    Lists render compactly (``[64,32]``); values longer than MLflow's limit are truncated with ``...``. A
    secret (a key like ``s3.secret-access-key``, ``token``, ``credential``; a URI's password) is logged as
    ``***``: params are plain text to everyone who can read the experiment.
    """
    flat: dict[str, str] = {}
    for key, value in cfg.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, name))
            continue
        text = "***" if is_secret(str(key)) and value else without_password(_render(value))
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            text = text[: MAX_PARAM_VALUE_LENGTH - len(_TRUNCATED)] + _TRUNCATED
        flat[name] = text
    return flat
