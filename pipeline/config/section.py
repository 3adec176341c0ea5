"""The base every config section builds on: frozen, no unknown keys, no inf/nan, no booleans for numbers.

Its own module so the sections kept outside ``schema`` (sources, train options, losses) share it without
importing ``schema`` (which imports them).
"""
from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# Seeds feed numpy, torch and Spark hashes: they must fit in a signed 64-bit integer.
SEED = {"ge": -2**63, "le": 2**63 - 1}


def number_type(annotation: Any) -> bool:
    """int/float fields, also inside Optional[...]."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(a in (int, float) for a in typing.get_args(annotation))
    return False


class Section(BaseModel):
    # allow_inf_nan=False: `.inf`/`.nan` are rejected for every float key (no infinite timeout or rate).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would read `true` as 1 for an int key; a boolean where a number belongs is a mistake.
        if isinstance(value, bool) and info.field_name and number_type(cls.model_fields[info.field_name].annotation):
            raise ValueError("a number is expected, not a boolean")
        return value
