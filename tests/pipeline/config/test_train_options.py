"""The train.* essentials' keys: defaults, ranges, and the combinations refused with the keys named."""
import pytest

from pipeline.config import build
from pipeline.errors import ConfigError


def test_defaults_change_nothing():
    t = build({}).train
    assert t.schedule.decay == "none" and t.schedule.warmup_steps == 0
    assert t.clip_grad_norm is None and t.precision == "fp32"
    assert not t.early_stopping.enabled and t.divergence.enabled is None


def test_the_divergence_guard_is_on_by_default_where_it_is_supported():
    from pipeline.config.train_options import divergence_on

    assert divergence_on(build({}))
    assert not divergence_on(build({"train": {"backend": "allreduce"}}))
    assert not divergence_on(build({"ps": {"placement": "task"}}))
    assert not divergence_on(build({"train": {"divergence": {"enabled": False}}}))
    build({"train": {"backend": "allreduce"}})  # the default does not refuse what it cannot watch


@pytest.mark.parametrize("changes, message", [
    ({"train": {"clip_grad_norm": 1.0}, "ps": {"shards": 2}}, "train.clip_grad_norm .* needs ps.shards=1"),
    ({"train": {"clip_grad_norm": 1.0}, "parallelism": {"pipeline": 2}}, "train.clip_grad_norm needs parallelism.pipeline=1"),
    ({"train": {"precision": "bf16"}, "parallelism": {"pipeline": 2}}, "train.precision=bf16 needs parallelism.pipeline=1"),
    ({"train": {"early_stopping": {"enabled": True}, "backend": "allreduce"}}, "train.early_stopping / train.divergence need"),
    ({"train": {"divergence": {"enabled": True}}, "ps": {"placement": "task"}}, "ps.placement=driver"),
    ({"train": {"schedule": {"decay": "exponential"}}}, "train.schedule.decay"),
    ({"train": {"divergence": {"factor": 1.0}}}, "train.divergence.factor"),
    ({"train": {"early_stopping": {"patience": True}}}, "train.early_stopping.patience"),
    ({"train": {"precision": "fp8"}}, "train.precision"),
], ids=["clip-shards", "clip-pipeline", "bf16-pipeline", "early-allreduce", "guard-task", "decay", "factor",
        "patience-bool", "precision"])
def test_unsupported_or_invalid_settings_are_refused_naming_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        build(changes)


def test_supported_combinations_build():
    build({"train": {"clip_grad_norm": 0.5, "precision": "bf16", "backend": "allreduce",
                     "schedule": {"warmup_steps": 5, "decay": "cosine"}}})
    build({"train": {"clip_grad_norm": 0.5}, "ps": {"mode": "average", "shards": 2}})  # local steps: not sharded
    build({"train": {"early_stopping": {"enabled": True}, "divergence": {"enabled": True}}, "ps": {"mode": "async"}})
