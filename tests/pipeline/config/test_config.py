import textwrap

import pytest

from pipeline.config import load, parse_override
from pipeline.errors import ConfigError


def test_digits_config_layers_on_base(conf_dir):
    cfg = load(f"{conf_dir}/digits.yaml")
    assert cfg.name == "digits"  # from the named config
    assert cfg.ps.mode == "sync"  # from base
    assert cfg.spark.conf["spark.ui.enabled"] == "false"
    assert cfg.model.hidden == [128, 64]


def test_overrides_are_typed_and_win(conf_dir):
    cfg = load(f"{conf_dir}/digits.yaml", ["parallelism.data=3", "train.epochs=5", "ps.mode=sync",
                                           "model.hidden=[8, 4]", "train.lr=0.5"])
    assert cfg.parallelism.data == 3
    assert cfg.train.epochs == 5
    assert cfg.model.hidden == [8, 4]
    assert cfg.train.lr == 0.5


def test_config_is_frozen(conf_dir):
    cfg = load(f"{conf_dir}/digits.yaml")
    with pytest.raises(Exception):
        cfg.train.epochs = 3


@pytest.mark.parametrize("override, key", [
    ("parallelism.data=0", "parallelism.data"),
    ("train.lr=-0.1", "train.lr"),
    ("train.epochs=abc", "train.epochs"),
    ("train.epochz=3", "train.epochz"),
    ("ps.timeout_s=0", "ps.timeout_s"),
    ("ps.mode=gossip", "ps.mode"),
    ("model.hidden=[64, -1]", "model.hidden"),
    ("model.factory=not-a-path", "model.factory"),
    ("data.split.train=0.9", "data.split"),
    ("nonsense.key=1", "nonsense"),
])
def test_invalid_values_name_the_key(conf_dir, override, key):
    with pytest.raises(ConfigError) as info:
        load(f"{conf_dir}/digits.yaml", [override])
    assert key in str(info.value)


def test_file_sources_require_a_path(conf_dir):
    with pytest.raises(ConfigError, match="data.path"):
        load(f"{conf_dir}/digits.yaml", ["data.source=csv"])


def test_malformed_override_and_missing_file(conf_dir, tmp_path):
    with pytest.raises(ConfigError, match="key.sub=value"):
        load(f"{conf_dir}/digits.yaml", ["train.epochs"])
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.yaml")


def test_named_config_outside_conf_uses_explicit_base(conf_dir, tmp_path):
    named = tmp_path / "mine.yaml"
    named.write_text(textwrap.dedent("""
        name: mine
        train: {epochs: 2}
    """))
    cfg = load(named, base=f"{conf_dir}/base.yaml")
    assert (cfg.name, cfg.train.epochs, cfg.train.batch_size) == ("mine", 2, 32)
    with pytest.raises(ConfigError, match="mapping"):
        (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
        load(tmp_path / "list.yaml")


def test_parse_override_nests_keys():
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": 1}}}
    assert parse_override("a=hello") == {"a": "hello"}


def test_with_changes_deep_merges_and_validates_again():
    from pipeline.config import build, with_changes
    from pipeline.errors import ConfigError

    cfg = build({"name": "base", "train": {"epochs": 3, "lr": 0.1}})
    changed = with_changes(cfg, name="small", train={"epochs": 1})
    assert (changed.name, changed.train.epochs, changed.train.lr) == ("small", 1, 0.1)
    assert cfg.train.epochs == 3  # the original is untouched (frozen)
    with pytest.raises(ConfigError, match="train.epochs"):
        with_changes(cfg, train={"epochs": 0})
    # Cross-section rules run too (model_copy would skip them).
    with pytest.raises(ConfigError, match="ps.mode=sync"):
        with_changes(cfg, parallelism={"pipeline": 2}, ps={"mode": "async"})
