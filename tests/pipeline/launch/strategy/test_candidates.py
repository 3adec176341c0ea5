"""What a config leaves open to train.backend=auto: fixed choices stay, freedoms need train.auto.allow."""
import pytest

from pipeline.config import load
from pipeline.errors import ConfigError
from pipeline.launch.strategy import candidates, has_auto

AUTO_ALL = ["train.backend=auto", "ps.placement=auto", "ps.mode=auto", "ps.compression=auto"]


def names(overrides):
    return {c.name for c in candidates(load("conf/digits.yaml", overrides))}


def test_by_default_only_exact_sync_strategies_are_open():
    assert names(AUTO_ALL) == {"allreduce", "ps driver sync", "ps hosts sync"}


def test_each_freedom_opens_its_strategies():
    opened = names([*AUTO_ALL, "train.auto.allow=[async,compression]"])
    assert {"ps driver async", "ps hosts async", "ps driver sync topk", "ps hosts async fp16"} <= opened
    assert not any(" ssp" in n or " average" in n for n in opened)
    assert "ps driver ssp" in names([*AUTO_ALL, "train.auto.allow=[ssp]"])


def test_a_fixed_backend_is_never_overridden():
    assert names(["train.backend=ps", "ps.placement=auto"]) == {"ps driver sync", "ps hosts sync"}
    assert names(["train.backend=allreduce"]) == {"allreduce"}  # the one strategy a fixed backend leaves
    assert not has_auto(load("conf/digits.yaml", ["train.backend=allreduce"]))


def test_a_fixed_mode_or_compression_is_kept_and_needs_no_freedom():
    # ps.mode=async fixed: async is the user's own choice, and allreduce (exact sync) is not what they asked for
    assert names(["train.backend=auto", "ps.mode=async"]) == {"ps driver async"}
    assert names(["train.backend=auto", "ps.compression=topk", "ps.placement=auto"]) == \
        {"ps driver sync topk", "ps hosts sync topk"}
    assert names(["train.backend=auto"]) == {"allreduce", "ps driver sync"}  # placement stays driver


def test_an_unknown_freedom_is_a_config_error_listing_the_allowed_values():
    with pytest.raises(ConfigError, match=r"train\.auto\.allow.*unknown 'fast'.*async, ssp, average, compression"):
        load("conf/digits.yaml", ["train.backend=auto", "train.auto.allow=[async,fast]"])


def test_auto_keys_pass_the_config_checks_the_pick_must_pass_later():
    # early stopping needs the PS: auto may still be asked for, allreduce is then ruled out at the choice
    cfg = load("conf/digits.yaml", [*AUTO_ALL, "train.early_stopping.enabled=true"])
    assert "allreduce" in {c.name for c in candidates(cfg)}
