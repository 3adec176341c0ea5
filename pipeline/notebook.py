"""Notebook helpers: widgets that work in Databricks and as plain scripts, shipping a notebook's own
module to executors, and the Databricks source format as jupytext's percent format."""
from __future__ import annotations

import os
import re
from types import ModuleType
from typing import Any, Optional

DATABRICKS_HEADER = "# Databricks notebook source"
DATABRICKS_SEPARATOR = "# COMMAND ----------"
_MAGIC = re.compile(r"^# MAGIC ?")


def _ipython_dbutils() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell.user_ns.get("dbutils") if shell is not None else None


def widget(name: str, default: str, dbutils: Optional[Any] = None, label: Optional[str] = None) -> str:
    """A text widget's value: dbutils.widgets in Databricks; else $SHARDLINE_WIDGET_<NAME>; else default."""
    utils = dbutils if dbutils is not None else _ipython_dbutils()
    if utils is not None:
        utils.widgets.text(name, default, label or name)
        return utils.widgets.get(name)
    return os.environ.get(f"SHARDLINE_WIDGET_{name.upper()}", default)


def ship_module(spark, module: ModuleType) -> str:
    """Make a single-file module the notebook imported (e.g. a model factory next to it) importable on
    every executor: `SparkContext.addPyFile`, or `addArtifacts(pyfile=True)` on Spark Connect. Returns
    the shipped file's path."""
    path = getattr(module, "__file__", None)
    if not path or os.path.basename(path) == "__init__.py":
        raise ValueError(f"ship_module ships one .py file; {module.__name__!r} is {path or 'not a file'} "
                         "(install a package on the cluster instead)")
    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect sessions have no SparkContext
        context = None
    if context is not None:
        context.addPyFile(path)
    else:
        spark.addArtifacts(path, pyfile=True)
    return path


def databricks_to_percent(text: str) -> str:
    """A Databricks source-format notebook as jupytext's percent format (`# %%` cells), which jupytext
    then reads into .ipynb: `# COMMAND ----------` separates cells, `# MAGIC %md` cells become markdown
    cells, other `# MAGIC` cells (%sh, %sql, ...) are kept as commented code."""
    lines = text.splitlines()
    if lines and lines[0].strip() == DATABRICKS_HEADER:
        lines = lines[1:]
    cells: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == DATABRICKS_SEPARATOR:
            cells.append([])
        else:
            cells[-1].append(line)
    out: list[str] = []
    for cell in cells:
        while cell and not cell[0].strip():
            cell.pop(0)
        while cell and not cell[-1].strip():
            cell.pop()
        if not cell:
            continue
        if all(_MAGIC.match(line) for line in cell) and _MAGIC.sub("", cell[0]).startswith("%md"):
            body = [_MAGIC.sub("", line) for line in cell]
            body[0] = body[0][len("%md"):].strip()
            if not body[0]:
                body.pop(0)
            out += ["# %% [markdown]", *[f"# {line}".rstrip() for line in body]]
        else:
            out += ["# %%", *cell]
        out.append("")
    return "\n".join(out)
