"""The docs pages generated from the code, so they cannot drift from it: the configuration reference
(every key of ``PipelineConfig``: type, default, meaning) and the troubleshooting page (every user-facing
error type, with its cause and fix).

    .venv/bin/python tools/docs_gen.py [--out docs/generated]     # `make docs` runs it before mkdocs

Meanings come from the schema's own comments: the comment lines right above a field, or the comment on
its line (the project writes a key's "why" there anyway); a field of a section type takes the section's
docstring when it has no comment. Why not pydantic ``Field(description=...)``: the comments already hold
the text, and a second copy in strings would drift from them. Troubleshooting entries live in
``docs/troubleshooting.yaml`` (one per error type: cause, fix, example messages); a new error type without
an entry, or an entry for a type that no longer exists, fails ``missing()`` and so the docs test.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import pkgutil
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.yaml"


# ------------------------------------------------------------------------------ configuration keys

def _field_comments(cls) -> dict[str, str]:
    """field name -> the comment above it (contiguous # lines) or on its line, from the class source."""
    try:
        lines, start = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    out: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        index = node.lineno - 1
        text = lines[index]
        inline = text.split("#", 1)[1].strip() if "#" in text and not text.strip().startswith("#") else ""
        above: list[str] = []
        j = index - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        meaning = " ".join(part for part in (" ".join(above), inline) if part)
        if meaning:
            out[node.target.id] = meaning
    return out


def _models_in(annotation) -> list:
    """The pydantic models inside an annotation (Optional[X], list[Union[str, A, B]], Annotated[...])."""
    from pydantic import BaseModel

    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += [m for m in _models_in(arg) if m not in found]
    return found


def _section_of(annotation) -> Any:
    """The one Section type of a nested section key (Optional[X], X), else None."""
    models = _models_in(annotation)
    return models[0] if len(models) == 1 and typing.get_origin(annotation) is not list else None


def _entry_models(annotation) -> list:
    """The entry types of a list key whose items are sections (data.features: one model per feature type)."""
    if typing.get_origin(annotation) is list or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                                 and any(typing.get_origin(a) is list for a in typing.get_args(annotation))):
        return _models_in(annotation)
    return []


def _type_text(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    for prefix in ("pipeline.config.", "<class '"):
        text = text.replace(prefix, "")
    return text.replace("'>", "")


def _default_text(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if hasattr(value, "model_dump"):
        return "(section)"
    return json.dumps(value, default=str)


def config_keys(cls=None, prefix: str = "") -> Iterator[dict]:
    """One row per key, depth first: key, type, default, meaning ("" when the schema says nothing)."""
    if cls is None:
        from pipeline.config.schema import PipelineConfig

        cls = PipelineConfig
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # mixins (LossFields) first, the class's own comments win
        if klass is cls or klass.__module__.startswith("pipeline.config"):
            comments.update(_field_comments(klass))
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        section = _section_of(field.annotation)
        meaning = comments.get(name, "")
        if section is not None and not meaning:  # its own docstring only (not pydantic's BaseModel's)
            own = inspect.cleandoc(section.__dict__.get("__doc__") or "")
            meaning = own.split("\n\n")[0].replace("\n", " ") or f"the `{key}.*` settings below"
        yield {"key": key, "type": "section" if section is not None else _type_text(field.annotation),
               "default": _default_text(field), "meaning": meaning}
        if section is not None:
            yield from config_keys(section, key + ".")
        for entry in _entry_models(field.annotation):  # list items: each kind's keys, named by its kind
            kind = entry.model_fields.get("type")
            label = f"[type: {kind.default}]" if kind is not None and isinstance(kind.default, str) else "[]"
            yield from config_keys(entry, f"{key}{label}.")


def config_page() -> str:
    rows = ["# Configuration reference", "",
            "Generated from `pipeline/config` by `tools/docs_gen.py`: every key, its type, its default and "
            "what it means (the schema's own comments). Set keys in YAML (`conf/base.yaml` + a named config) "
            "or as `key.sub=value` overrides; see [Configuration](../configuration.md) for the layering.", "",
            "| key | type | default | meaning |", "|---|---|---|---|"]
    for row in config_keys():
        cells = [f"`{row['key']}`", f"`{row['type']}`".replace("|", "\\|"), f"`{row['default']}`".replace("|", "\\|"),
                 row["meaning"].replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------------------------ error types

def error_types() -> dict[str, type]:
    """Every exception class defined in pipeline/ and udfs/ that users can see: ShardlineError subclasses
    and the other exceptions raised across the API (found by importing every module)."""
    import pipeline
    from pipeline.errors import ShardlineError

    for module in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
        importlib.import_module(module.name)
    found: dict[str, type] = {}
    stack = [ShardlineError]
    while stack:
        cls = stack.pop()
        if cls.__module__.startswith(("pipeline.", "udfs.")):  # not subclasses a test or a user defines
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
        stack.extend(cls.__subclasses__())
    return found


def _entries() -> dict[str, dict]:
    import yaml

    return yaml.safe_load(TROUBLESHOOTING.read_text()) or {}


def missing() -> dict[str, list[str]]:
    """{"undocumented": error types without an entry, "stale": entries naming no error type,
    "incomplete": entries without cause or fix}."""
    names, entries = set(error_types()), _entries()
    return {"undocumented": sorted(names - set(entries)), "stale": sorted(set(entries) - names),
            "incomplete": sorted(k for k, v in entries.items() if not (v or {}).get("cause") or not (v or {}).get("fix"))}


def troubleshooting_page() -> str:
    types, entries = error_types(), _entries()
    groups: dict[str, list[str]] = {}
    for name in sorted(entries):
        groups.setdefault(entries[name].get("group", "Other"), []).append(name)
    out = ["# Troubleshooting", "",
           "Every error type shardline raises, grouped by where it shows up, with its cause and the fix. "
           "Generated from `docs/troubleshooting.yaml` and the error classes by `tools/docs_gen.py`; the docs "
           "test fails when an error type has no entry.", ""]
    for group in sorted(groups):
        out += [f"## {group}", ""]
        for name in groups[group]:
            entry, cls = entries[name], types.get(name)
            bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__) if cls else ""
            out += [f"### `{name.rsplit('.', 1)[1]}`", "", f"`{name}` (a {bases})" if bases else f"`{name}`", ""]
            for message in entry.get("messages") or []:
                out += [f"> {message}", ""]
            out += [f"**Cause.** {entry['cause']}", "", f"**Fix.** {entry['fix']}", ""]
    return "\n".join(out)


def generate(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("config-reference.md", config_page()), ("troubleshooting.md", troubleshooting_page())):
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "generated"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    for path in generate(Path(args.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
