"""Notebook helpers: widgets that work in Databricks and as plain scripts."""
from __future__ import annotations

import os
from typing import Any, Optional


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
