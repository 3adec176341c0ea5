"""What a model read back from an artifact may make us run, and whether its state is the one written.

A checkpoint, a logged ``shardline/model.pt`` or a saved Spark ML model names the model to rebuild: a
built-in kind, or a ``model.factory`` "package.module:function" that is imported and called. Read back,
that name is data from storage, so a tampered artifact could pick any importable callable
(``os:system``). :func:`check_factory` lets through only the built-ins and the factories the running
config names (``model.factory`` and ``model.allowed_factories``); it runs before anything is imported.

:func:`state_digest` is the digest written next to the state (spec + flat fp32 state) and checked
before use: HMAC-SHA256 under ``$SHARDLINE_ARTIFACT_KEY`` when that key is set (then an artifact cannot be
altered by someone without the key), else SHA-256 (catches corruption and careless edits; whoever can
rewrite the artifact can rewrite a plain digest too, which is why the factory check does not rely on it).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Iterable, Optional

from pipeline.errors import ConfigError

KEY_ENV = "SHARDLINE_ARTIFACT_KEY"
ALLOWED_KEY = "model.allowed_factories"
BUILT_IN_KINDS = frozenset({"mlp", "tabular", "logreg", "cnn"})


class ArtifactTrustError(ConfigError):
    """An artifact names code the running config does not allow, or its state fails its digest."""


def allowed_factories(model_config) -> frozenset[str]:
    """model.factory plus model.allowed_factories of a ModelConfig."""
    names = set(getattr(model_config, "allowed_factories", ()) or ())
    if getattr(model_config, "factory", None):
        names.add(model_config.factory)
    return frozenset(names)


def check_factory(spec: dict[str, Any], allowed: Iterable[str], source: str) -> None:
    """Refuse a spec read from ``source`` whose kind is not a built-in, or whose factory is not allowed."""
    allowed = frozenset(allowed)
    kind, factory = spec.get("kind"), spec.get("factory")
    if factory is None and kind in BUILT_IN_KINDS:
        return
    if kind not in BUILT_IN_KINDS | {"factory"}:
        raise ArtifactTrustError(f"{source} names model kind {kind!r}, which is not a built-in "
                                 f"({', '.join(sorted(BUILT_IN_KINDS))}); refusing to build it")
    if factory not in allowed:
        listed = ", ".join(sorted(allowed)) or "none"
        raise ArtifactTrustError(
            f"{source} names model.factory {factory!r}, which the running config does not allow (model.factory / "
            f"{ALLOWED_KEY}: {listed}); refusing to import it. If the artifact is yours, add {factory!r} to "
            f"{ALLOWED_KEY} (or set model.factory to it)")


def _key() -> Optional[bytes]:
    key = os.environ.get(KEY_ENV)
    return key.encode("utf-8") if key else None


def state_digest(spec: dict[str, Any], state_bytes: bytes) -> str:
    """``sha256:<hex>`` or ``hmac-sha256:<hex>`` over the canonical JSON spec and the state's bytes."""
    body = json.dumps(spec, sort_keys=True, default=str).encode() + b"\0" + bytes(state_bytes)
    key = _key()
    if key is not None:
        return "hmac-sha256:" + hmac.new(key, body, hashlib.sha256).hexdigest()
    return "sha256:" + hashlib.sha256(body).hexdigest()


def verify_state(spec: dict[str, Any], state_bytes: bytes, recorded: Optional[str], source: str) -> None:
    """Refuse state whose recorded digest is missing or does not match (compared in constant time)."""
    if not recorded:
        raise ArtifactTrustError(f"{source} carries no state digest (written before digests, or stripped); "
                                 "refusing to use it: re-train or re-log the model with this shardline")
    scheme = str(recorded).split(":", 1)[0]
    if scheme == "hmac-sha256" and _key() is None:
        raise ArtifactTrustError(f"{source} is signed with a key (hmac-sha256) but ${KEY_ENV} is not set here; "
                                 f"set it to the key the artifact was written with")
    if not hmac.compare_digest(state_digest(spec, state_bytes), str(recorded)):
        raise ArtifactTrustError(f"{source}: the model state does not match its {scheme} digest (corrupt, "
                                 f"tampered with, or written under another ${KEY_ENV}); refusing to use it")


def flat_bytes(parameters) -> bytes:
    """The flat fp32 state as little-endian bytes (a tensor, an array or bytes)."""
    import numpy as np

    if isinstance(parameters, (bytes, bytearray, memoryview)):
        return bytes(parameters)
    if hasattr(parameters, "detach"):
        parameters = parameters.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(parameters, dtype="<f4").tobytes()


def seal_model(spec: dict[str, Any], parameters) -> dict[str, Any]:
    """The model.pt dict: spec, flat state and their digest."""
    return {"spec": spec, "parameters": parameters, "digest": state_digest(spec, flat_bytes(parameters))}


def open_model(state: dict[str, Any], allowed: Iterable[str], source: str) -> dict[str, Any]:
    """A loaded model.pt dict, checked: its factory allowed, its state matching its digest."""
    spec = state.get("spec")
    if not isinstance(spec, dict) or "parameters" not in state:
        raise ArtifactTrustError(f"{source} is not a shardline model (no spec / parameters)")
    check_factory(spec, allowed, source)
    verify_state(spec, flat_bytes(state["parameters"]), state.get("digest"), source)
    return state
