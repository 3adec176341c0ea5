"""Every invalid config value is rejected at load, through the real loader, naming the dotted key.

The cases are generated from the schema itself (pydantic field types and constraints), so a key added to
pipeline/config/schema.py is covered without touching this file; explicit cases cover the validators
that introspection cannot see (cross-field rules, custom checks). tests/pipeline/config/test_config.py
holds the original handful of explicit cases; none of them is repeated here.
"""
from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, Iterator, Literal

import annotated_types as at
import pytest
from pydantic import BaseModel

from pipeline.config import load
from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, FieldInfo, inner type) of every field, sections included, depth first."""
    for name, info in model.model_fields.items():
        key, inner = prefix + name, _unwrap(info.annotation)
        yield key, info, inner
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _leaves(inner, key + ".")


def _bad_by_type(inner: Any) -> list[tuple[str, str]]:
    """(YAML text, why) values of the wrong type for a field of type `inner`."""
    origin = typing.get_origin(inner)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return [("3", "a number for a section"), ("[1, 2]", "a list for a section")]
    if origin is Literal:
        return [('"__not_a_choice__"', "not one of the choices"), ("[1]", "a list")]
    if inner is bool:
        return [('"perhaps"', "not a boolean"), ("[true]", "a list")]
    if inner is int:
        return [('"abc"', "text"), ("1.5", "a fraction"), ("true", "a boolean"), ("[1]", "a list")]
    if inner is float:
        return [('"abc"', "text"), (".inf", "infinite"), (".nan", "not a number"), ("true", "a boolean")]
    if inner is str:
        return [("[1, 2]", "a list"), ("{a: 1}", "a mapping")]
    if origin is list:
        return [('"scalar"', "text for a list"), ("{a: 1}", "a mapping for a list")]
    if origin is dict:
        return [("[1, 2]", "a list for a mapping"), ('"scalar"', "text for a mapping")]
    if inner is Any:
        return []
    if origin in (typing.Union, types.UnionType) and {typing.get_origin(a) for a in typing.get_args(inner)} - {None} == {list, dict}:
        return [('"scalar"', "text for a list or mapping"), ("3", "a number for a list or mapping")]
    raise AssertionError(f"no wrong-type values for {inner!r}: teach _bad_by_type about it")


def _general(info, attribute: str):
    for meta in info.metadata:
        value = getattr(meta, attribute, None)
        if value is not None:
            return value
    return None


def _bad_by_constraint(inner: Any, info) -> list[tuple[str, str]]:
    """(YAML text, why) values just outside each declared constraint (bounds, lengths, pattern)."""
    cases = []
    step = 1 if inner is int else 0.5
    item = typing.get_args(inner)[0] if typing.get_origin(inner) is list else None
    for meta in info.metadata:
        if isinstance(meta, at.Gt):
            cases.append((json.dumps(meta.gt), f"not > {meta.gt}"))
        elif isinstance(meta, at.Ge):
            cases.append((json.dumps(meta.ge - step), f"below {meta.ge}"))
        elif isinstance(meta, at.Lt):
            cases.append((json.dumps(meta.lt), f"not < {meta.lt}"))
        elif isinstance(meta, at.Le):
            cases.append((json.dumps(meta.le + step), f"above {meta.le}"))
        elif isinstance(meta, at.MinLen) and meta.min_length > 0:
            short = "x" * (meta.min_length - 1) if inner is str else [f"v{i}" for i in range(meta.min_length - 1)]
            cases.append((json.dumps(short), f"shorter than {meta.min_length}"))
        elif isinstance(meta, at.MaxLen):
            assert item is str or inner is str, f"teach _bad_by_constraint MaxLen on {inner!r}"
            long = "x" * (meta.max_length + 1) if inner is str else [f"v{i}" for i in range(meta.max_length + 1)]
            cases.append((json.dumps(long), f"longer than {meta.max_length}"))
    pattern = _general(info, "pattern")
    if pattern is not None:
        bad = "not valid / at all!"
        assert not re.match(pattern, bad)
        cases.append((json.dumps(bad), f"not matching {pattern}"))
    return cases


def _constrained(info, inner) -> bool:
    return bool(info.metadata) or typing.get_origin(inner) is Literal


CASES = [(key, text, why) for key, info, inner in _leaves(PipelineConfig)
         for text, why in _bad_by_constraint(inner, info) + _bad_by_type(inner)]
CONSTRAINED = sorted(key for key, info, inner in _leaves(PipelineConfig) if _constrained(info, inner))


def _rejected(override: str) -> str:
    with pytest.raises(ConfigError) as info:
        load("conf/digits.yaml", [override])
    return str(info.value)


def _names(message: str, key: str) -> bool:
    """The loader writes one `  key: problem` line per error; a list item or mapping entry is key.N / key.x."""
    return re.search(rf"^\s+{re.escape(key)}[.:]", message, re.MULTILINE) is not None


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, conf_dir):
    monkeypatch.chdir(conf_dir.rsplit("/", 1)[0])


def test_the_generated_cases_cover_every_constrained_key():
    keys = {key for key, _, _ in CASES}
    assert set(CONSTRAINED) <= keys
    # a sample of what the schema constrains today, so an introspection bug cannot make this vacuous
    assert {"name", "parallelism.data", "train.batch_size", "train.lr", "ps.mode", "ps.topk_ratio",
            "data.split.train", "data.synthetic.classes", "data.classes", "data.invalid_rows",
            "shards.target_file_mb", "faults.fail_rank"} <= set(CONSTRAINED)
    every_leaf = {key for key, _, inner in _leaves(PipelineConfig) if inner is not Any}
    assert every_leaf <= keys  # every key gets at least a wrong-type case


@pytest.mark.parametrize("key, text, why", CASES, ids=[f"{k}={t[:20]}" for k, t, _ in CASES])
def test_generated_invalid_value_is_rejected_naming_the_key(key, text, why):
    message = _rejected(f"{key}={text}")
    assert _names(message, key), f"{key}={text} ({why}) was rejected without naming {key}:\n{message}"


@pytest.mark.parametrize("override, key", [
    # unknown keys, at every depth
    ("data.synthetic.bogus=1", "data.synthetic.bogus"),
    ("ps.topk=0.1", "ps.topk"),
    # wrong types
    ("data.features=f1", "data.features"),
    ("data.split=0.7", "data.split"),
    ("spark.conf={spark.ui.enabled: false}", "spark.conf.spark.ui.enabled"),
    ("data.csv_options={header: true}", "data.csv_options.header"),
    ("model.hidden=[64, wide]", "model.hidden.1"),
    ("train.epochs=", "train.epochs"),
    # negative
    ("parallelism.data=-2", "parallelism.data"),
    ("train.batch_size=-32", "train.batch_size"),
    ("data.shuffle_buffer_rows=-1", "data.shuffle_buffer_rows"),
    ("ps.staleness=-1", "ps.staleness"),
    # fractions out of range
    ("data.split.train=1.5", "data.split.train"),
    ("data.split.validation=-0.1", "data.split.validation"),
    ("model.dropout=1", "model.dropout"),
    ("ps.topk_ratio=0", "ps.topk_ratio"),
    ("ps.topk_ratio=1.01", "ps.topk_ratio"),
    # empty names and infinite numbers
    ("data.label=''", "data.label"),
    ("workdir=''", "workdir"),
    ("ps.timeout_s=.inf", "ps.timeout_s"),
    ("train.seed=18446744073709551616", "train.seed"),
])
def test_explicit_invalid_values_name_the_key(override, key):
    message = _rejected(override)
    assert _names(message, key), message


@pytest.mark.parametrize("overrides, key, says", [
    (["data.split.train=0.5"], "data.split", "sum to 1"),
    (["data.split.train=0.6", "data.split.validation=0.3", "data.split.test=0.2"], "data.split", "sum to 1"),
    (["data.source=parquet"], "data.path", "required"),
    (["data.source=clicks", "data.path=s3://bucket/raw"], "data.path", "data.source=parquet and data.path=<that URL>"),
    (["data.features=[pixel_00, label]"], "data.features", "label"),
    (["data.features=[]"], "data.features", "at least one"),
    (["data.features=[pixel_00, pixel_00]"], "data.features", "more than once"),
    (["data.classes=[cat]"], "data.classes", "at least 2"),
    (["data.classes=[cat, dog, cat]"], "data.classes", "more than once"),
    (["data.classes=[cat, '']"], "data.classes", "empty"),
    (["data.classes=[0.5, 1]"], "data.classes", "string"),
    (["data.classes=[0, 1]", "data.task=regression"], "data.classes", "data.task=classification"),
    (["model.factory=pkg.mod"], "model.factory", "package.module:function"),
    (["model.hidden=[0]"], "model.hidden", "positive"),
])
def test_cross_field_and_custom_rules_name_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as info:
        load("conf/digits.yaml", overrides)
    message = str(info.value)
    assert key in message and says in message, message


def test_valid_classes_load_as_text_in_the_given_order():
    cfg = load("conf/digits.yaml", ["data.classes=[9, 0, 5]"])
    assert cfg.data.classes == ["9", "0", "5"]
    assert load("conf/digits.yaml").data.classes is None  # default: learned from the data
