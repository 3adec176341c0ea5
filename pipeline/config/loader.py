"""Loading: conf/base.yaml, then a named config on top, then `key.sub=value` overrides.

Layering is a deep merge of plain mappings; validation happens once, on the merged result, so an
error names the final dotted key whichever layer it came from.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from pydantic import ValidationError

from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError

BASE_NAME = "base.yaml"


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay wins; nested mappings merge key by key; lists and scalars are replaced whole."""
    merged = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level, found {type(data).__name__}")
    return data


def parse_override(text: str) -> dict[str, Any]:
    """`train.epochs=5` -> {"train": {"epochs": 5}}; the value is parsed as YAML (so 5 is an int)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value (e.g. train.epochs=5)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {exc}") from None
    return nested(key, value)


def nested(key: str, value: Any) -> dict[str, Any]:
    """`("train.epochs", 5)` -> {"train": {"epochs": 5}}: a dotted key as the dict a deep merge takes."""
    out: dict[str, Any] = {}
    cursor = out
    *parents, leaf = key.split(".")
    for part in parents:
        cursor = cursor.setdefault(part, {})
    cursor[leaf] = value
    return out


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (check the spelling; see conf/base.yaml for every key)")
        else:
            given = err.get("input")
            shown = "" if isinstance(given, (dict, list)) or given is None else f" (got {given!r})"
            lines.append(f"  {key}: {err['msg']}{shown}")
    return "\n".join(lines)


def build(raw: Mapping[str, Any], source: str = "<dict>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def with_changes(cfg: PipelineConfig, **changes: Any) -> PipelineConfig:
    """A validated copy of `cfg` with `changes` deep-merged in, e.g.
    ``with_changes(cfg, name="small", train={"epochs": 2})`` (every validator runs again, unlike
    pydantic's model_copy)."""
    return build(deep_merge(cfg.model_dump(), changes), f"{cfg.name} with changes {sorted(changes)}")


def load(config: str | os.PathLike | None = None, overrides: Iterable[str] = (),
         base: str | os.PathLike | None = None) -> PipelineConfig:
    """Resolve base + named config + overrides into a validated, frozen PipelineConfig.

    `base` defaults to base.yaml next to the named config (or ./conf/base.yaml); it is optional so a
    config outside the repository still loads on the schema's defaults.
    """
    layers: list[str] = []
    config_path = Path(config) if config is not None else None
    if base is None:
        folder = config_path.parent if config_path is not None else Path("conf")
        candidate = folder / BASE_NAME
        base_path = candidate if candidate.exists() else None
    else:
        base_path = Path(base)
    merged: dict[str, Any] = {}
    if base_path is not None:
        merged = read_yaml(base_path)
        layers.append(str(base_path))
    if config_path is not None and (base_path is None or config_path.resolve() != base_path.resolve()):
        merged = deep_merge(merged, read_yaml(config_path))
        layers.append(str(config_path))
    override_list = list(overrides)
    for override in override_list:
        merged = deep_merge(merged, parse_override(override))
    if override_list:
        layers.append("overrides " + " ".join(override_list))
    return build(merged, " + ".join(layers) or "defaults")
