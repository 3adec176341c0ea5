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
    from mlflow import MlflowClient

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
