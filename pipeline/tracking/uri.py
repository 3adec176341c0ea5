"""Where runs are recorded: the tracking URI and the artifact root that goes with a SQLite store."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import unquote

logger = logging.getLogger(__name__)

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
_SQLITE_PREFIX = "sqlite:///"


def resolve_tracking_uri(configured: str | None, workdir: str | os.PathLike) -> str:
    """Pick the tracking URI: config key ``tracking.uri`` > env ``MLFLOW_TRACKING_URI`` > SQLite in workdir.

    The default is ``sqlite:///<abs workdir>/mlflow.db``; the workdir is created if missing.
    """
    if configured and configured.strip():
        logger.debug("tracking URI from config: %s", configured)
        return configured.strip()
    from_env = os.environ.get(TRACKING_URI_ENV, "").strip()
    if from_env:
        logger.debug("tracking URI from %s: %s", TRACKING_URI_ENV, from_env)
        return from_env
    root = Path(workdir).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = f"{_SQLITE_PREFIX}{root}/mlflow.db"
    logger.debug("tracking URI defaulted to %s", uri)
    return uri


def sqlite_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """A ``file://`` artifact root beside a SQLite database, or None for any other store.

    Without one, MLflow puts the artifacts of a SQLite-backed experiment in ``./mlruns`` under
    whatever directory the process happens to run in.
    """
    if not tracking_uri.startswith(_SQLITE_PREFIX):
        return None
    db_path = unquote(tracking_uri[len(_SQLITE_PREFIX):].split("?", 1)[0])
    if not db_path or db_path == ":memory:":
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    return (Path(db_path).resolve().parent / "mlartifacts" / slug).as_uri()
