"""Where runs are recorded: the tracking URI and the artifact root that goes with a SQLite store."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import unquote

from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import SQLITE_PREFIX as _SQLITE_PREFIX
from pipeline.config.workdir import TRACKING_URI_ENV, pick_tracking_uri, tracking_db

logger = logging.getLogger(__name__)


def resolve_tracking_uri(configured: str | None, workdir: str | os.PathLike) -> str:
    """Pick the tracking URI: config key ``tracking.uri`` > env ``MLFLOW_TRACKING_URI`` > SQLite in workdir.

    The default is ``sqlite:///<abs workdir>/mlflow.db`` (`Workdir.tracking_db`); the workdir is created
    if missing, since SQLite creates the file but not its folder.
    """
    uri, source = pick_tracking_uri(configured, workdir)
    if source == "default":
        tracking_db(workdir).parent.mkdir(parents=True, exist_ok=True)
        logger.debug("tracking URI defaulted to %s", uri)
    else:
        logger.debug("tracking URI from %s: %s", source, uri)
    return uri


def tracking_uri_of(cfg: PipelineConfig) -> str:
    """The tracking URI of a config, its store's folder created (see resolve_tracking_uri)."""
    return resolve_tracking_uri(cfg.tracking.uri, cfg.workdir)


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
