"""The MLflow Model Registry side of promotion: versions, the champion/challenger aliases, artifacts."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    run_id: str


def _client(tracking_uri: str):
    import mlflow
    from mlflow import MlflowClient

    # The registry's store resolves a `models:/m-<id>` source through MLflow's process-wide tracking URI,
    # not the client's: in a fresh process (`shardline promote` alone) that would be ./mlruns and the
    # logged model "not found". start_run sets it the same way.
    mlflow.set_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def register(tracking_uri: str, model_uri: str, name: str, run_id: str,
             tags: Optional[Mapping[str, str]] = None) -> RegisteredVersion:
    """A new version of registered model `name` from `model_uri` (the model logged by run `run_id`)."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    # MLflow 3 logged models (models:/m-<id>) are registered by their model id.
    model_id = model_uri.split("/", 1)[1] if model_uri.startswith("models:/m-") else None
    version = client.create_model_version(name, model_uri, run_id=run_id, tags=dict(tags or {}), model_id=model_id)
    return RegisteredVersion(name, str(version.version), run_id)


def alias_version(tracking_uri: str, name: str, alias: str) -> Optional[RegisteredVersion]:
    """The version that holds `alias`, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        version = _client(tracking_uri).get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return RegisteredVersion(name, str(version.version), version.run_id)


def set_alias(tracking_uri: str, version: RegisteredVersion, alias: str, reason: str) -> None:
    client = _client(tracking_uri)
    client.set_registered_model_alias(version.name, alias, version.version)
    client.set_model_version_tag(version.name, version.version, f"shardline.{alias}_reason", reason[:5000])
    log.info("model %s version %s is now %s: %s", version.name, version.version, alias, reason)


def download(tracking_uri: str, run_id: str, artifact_path: str, destination: str) -> str:
    """A run's artifact as a local file path."""
    return _client(tracking_uri).download_artifacts(run_id, artifact_path, destination)


def resolve_model(tracking_uri: str, model_uri: str) -> RegisteredVersion:
    """The registered version (and its training run) behind a model URI.

    Accepts `models:/NAME@ALIAS`, `models:/NAME/VERSION`, `models:/NAME/latest`, `models:/m-<id>` (an MLflow 3
    logged model; version "") and `runs:/RUN_ID[/...]` (name and version ""). Raises TrackingError naming
    what is missing (unknown model, alias or version) and what exists.
    """
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.run import TrackingError

    client = _client(tracking_uri)
    if model_uri.startswith("runs:/"):
        run_id = model_uri[len("runs:/"):].split("/", 1)[0]
        if not run_id:
            raise TrackingError(f"model URI {model_uri!r} names no run id (expected runs:/RUN_ID)")
        return RegisteredVersion("", "", run_id)
    if not model_uri.startswith("models:/"):
        raise TrackingError(f"model URI {model_uri!r}: expected models:/NAME@ALIAS, models:/NAME/VERSION, "
                            "models:/m-<id> or runs:/RUN_ID")
    rest = model_uri[len("models:/"):].rstrip("/")
    try:
        if rest.startswith("m-") and "@" not in rest and "/" not in rest:
            logged = client.get_logged_model(rest)
            return RegisteredVersion("", "", logged.source_run_id)
        if "@" in rest:
            name, alias = rest.rsplit("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = rest.rpartition("/")
            if not name:
                raise TrackingError(f"model URI {model_uri!r} names no version or alias "
                                    "(use models:/NAME@champion or models:/NAME/3)")
            if number == "latest":
                versions = client.search_model_versions(f"name='{name}'")
                if not versions:
                    raise TrackingError(f"registered model {name!r} has no versions ({tracking_uri})")
                version = max(versions, key=lambda v: int(v.version))
            else:
                version = client.get_model_version(name, number)
    except MlflowException as exc:
        raise TrackingError(f"cannot resolve model URI {model_uri!r} at {tracking_uri}: {exc.message}") from None
    if not version.run_id:
        raise TrackingError(f"{model_uri} (version {version.version}) records no training run; shardline needs "
                            "the run's shardline/model.pt and data/manifest.json artifacts")
    return RegisteredVersion(version.name, str(version.version), version.run_id)
