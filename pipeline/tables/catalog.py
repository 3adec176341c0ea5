"""The optional libraries and the Iceberg catalog, each loaded with an error that names the fix."""
from __future__ import annotations

import logging

from pipeline.errors import TableError

log = logging.getLogger(__name__)


def require(module: str, extra: str):
    """Import `module` (deltalake, pyiceberg), or a TableError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TableError(f"{module} is not installed ({exc}); install the extra: pip install 'shardline[{extra}]' "
                         "(it needs pyarrow >= 16: not on the LTS stack)") from None


def iceberg_catalog(config):
    """The pyiceberg catalog of `config` (IcebergConfig: name + properties), or a TableError naming it."""
    require("pyiceberg", "iceberg")
    from pyiceberg.catalog import load_catalog

    try:
        return load_catalog(config.name, **config.catalog)
    except Exception as exc:  # ValueError (no such catalog/type), NotInstalledError, a refused connection
        raise TableError(f"Iceberg catalog {config.name!r} cannot be loaded ({type(exc).__name__}: {exc}); set "
                         "data.iceberg.catalog to its properties, e.g. {type: sql, uri: 'sqlite:////path/catalog.db', "
                         "warehouse: 'file:///path/warehouse'} or {type: rest, uri: 'https://...'}") from None


def iceberg_table(config, identifier: str):
    """The Iceberg table `identifier` (namespace.table) of the catalog `config`, or a TableError."""
    catalog = iceberg_catalog(config)
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return catalog.load_table(identifier)
    except (NoSuchTableError, NoSuchNamespaceError, ValueError) as exc:
        raise TableError(f"Iceberg table {identifier!r} is not in catalog {config.name!r} ({exc}); set data.path "
                         "to namespace.table of a table that exists there") from None
