"""A user's ``"package.module:function"`` (model.factory, model.loss) imported and checked, one way for both."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def resolve_callable(path: str, key: str) -> Callable[..., Any]:
    """The callable ``path`` names; a ConfigError naming ``key`` when it cannot be imported or is not callable."""
    from pipeline.errors import ConfigError

    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({exc}); it must be importable on "
                          "the driver and on every executor") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{key}: {module_name!r} has no callable {attr!r}")
    return factory
