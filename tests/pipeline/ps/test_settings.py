"""PSSettings: one frozen value a server is built from, checked where it is made."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline.errors import ConfigError, PSError
from pipeline.ps import OptimizerSpec, PSSettings
from pipeline.ps.modes.consistency import Consistency
from pipeline.wire.deadline import STEP_KEY, Timeout


def test_defaults_and_the_step_deadline_follows_ps_timeout_s():
    settings = PSSettings(optimizer=OptimizerSpec())
    assert settings.consistency == Consistency() and settings.compression == "none"
    assert settings.topk_ratio == 0.01 and settings.shards == 1 and settings.server_threads == 0
    assert settings.step_timeout == Timeout.of(60.0, STEP_KEY)
    assert settings.step_timeout.hint == "raise timeouts.step_s (unset: it follows ps.timeout_s)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.shards = 2  # type: ignore[misc]


@pytest.mark.parametrize("options, match", [
    ({"optimizer": "sgd"}, "OptimizerSpec"),
    ({"consistency": "sync"}, "Consistency"),
    ({"compression": "zip"}, "ps.compression"),
    ({"compression": "topk", "topk_ratio": 0.0}, "topk"),
    ({"topk_ratio": "0.1"}, "ps.topk_ratio"),
    ({"shards": 0}, "ps.shards"),
    ({"shards": 1.5}, "ps.shards"),
    ({"step_timeout": 5.0}, "Timeout"),
    ({"server_threads": -1}, "ps.server_threads"),
    ({"server_threads": True}, "ps.server_threads"),
    ({"server_threads": 1.5}, "ps.server_threads"),
])
def test_invalid_settings_are_refused_naming_the_setting(options, match):
    with pytest.raises(PSError, match=match):
        PSSettings(**{"optimizer": OptimizerSpec(), **options})


def test_a_zero_step_deadline_names_both_keys():
    with pytest.raises(PSError, match=r"timeouts\.step_s \(from ps\.timeout_s\) must be > 0"):
        PSSettings(optimizer=OptimizerSpec(), step_timeout=Timeout.of(0, STEP_KEY))


def test_an_invalid_optimizer_fails_where_the_spec_is_made():
    with pytest.raises(ConfigError, match="train.lr"):
        PSSettings(optimizer=OptimizerSpec(lr=0.0))


def test_for_slice_never_gives_more_shards_than_parameters():
    settings = PSSettings(optimizer=OptimizerSpec(), shards=4, topk_ratio=1)
    assert settings.for_slice(3).shards == 3 and settings.for_slice(10).shards == 4
    assert isinstance(settings.topk_ratio, float)
