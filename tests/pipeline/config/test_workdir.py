"""Workdir: every path under cfg.workdir, pinned to the strings the modules computed before it existed.

The `legacy_*` expectations are the old modules' expressions, copied verbatim: existing workdirs (and the
shard roots recorded in workflow state) were laid out by them, so a Workdir path may not differ by a byte.
"""
import dataclasses
import os
import re
from pathlib import Path

import pytest

from pipeline.config import PipelineConfig, Workdir, build

NAME = "job.1"


@pytest.fixture(autouse=True)
def _no_tracking_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(params=["absolute", "relative", "dotted"])
def workdir(request, tmp_path, monkeypatch):
    """An absolute workdir, a relative one, and a relative one with `..` (where abspath, Path.absolute
    and Path.resolve disagree) — all run from inside tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    return {"absolute": str(tmp_path / "work"), "relative": "work", "dotted": "sub/../work"}[request.param]


def config(workdir: str, **sections) -> PipelineConfig:
    return build({"name": NAME, "workdir": workdir, **sections}, "test_workdir")


# --- the old expressions, verbatim ----------------------------------------------------------------

def legacy_shards_dir(cfg):  # pipeline/etl/run.py
    return Path(cfg.data.shards_dir) if cfg.data.shards_dir else Path(cfg.workdir) / "shards" / cfg.name


def legacy_model_dir(cfg):  # pipeline/steps.py
    return Path(cfg.workdir) / "models" / cfg.name


def legacy_checkpoint_dir(cfg):  # pipeline/launch/train.py
    return cfg.train.checkpoint_dir or os.path.join(os.path.abspath(cfg.workdir), "checkpoints", cfg.name)


def legacy_state_dir(cfg):  # pipeline/workflow.py
    return Path(cfg.workflow.state_dir or Path(cfg.workdir) / "workflow" / cfg.name)


def legacy_default_tracking_uri(workdir):  # pipeline/tracking/uri.py
    return f"sqlite:///{Path(workdir).expanduser().resolve()}/mlflow.db"


def legacy_digits(data, workdir):  # pipeline/etl/sources.py
    return Path(data.path) if data.path else Path(workdir) / "raw" / "digits"


def legacy_synthetic(data, workdir):  # pipeline/etl/synthetic.py
    if data.path:
        return Path(data.path)
    s = data.synthetic
    kind = f"c{s.classes}" if data.task == "classification" else "regression"
    return Path(workdir) / "raw" / f"synthetic-{s.rows}x{s.features}-{kind}-s{s.seed}"


def legacy_spark_ml(cfg):  # pipeline/spark_ml.py
    return Path(cfg.workdir).resolve() / "spark_ml" / cfg.name


def assert_same(got, expected):
    assert type(got) is type(expected), (got, expected)
    assert str(got) == str(expected)


# --- every path ---------------------------------------------------------------------------------

def test_default_config_paths(workdir, tmp_path):
    cfg = config(workdir)
    wd = Workdir.of(cfg)
    assert wd.root == tmp_path / "work" and wd.root.is_absolute()
    assert_same(wd.raw, Path(workdir) / "raw")
    assert_same(wd.raw_digits, legacy_digits(cfg.data, workdir))
    assert_same(wd.raw_synthetic, legacy_synthetic(cfg.data, workdir))
    assert wd.raw_synthetic.parent == wd.raw
    assert_same(wd.shards, legacy_shards_dir(cfg))
    assert_same(wd.shards, Path(workdir) / "shards" / NAME)
    assert_same(wd.shard_partition("date", "2024-01-02"), legacy_shards_dir(cfg) / "date=2024-01-02")
    assert_same(wd.models, legacy_model_dir(cfg))
    assert_same(wd.checkpoints, legacy_checkpoint_dir(cfg))
    assert wd.checkpoints == f"{tmp_path}/work/checkpoints/{NAME}"  # absolute even for a relative workdir
    assert_same(wd.workflow_state, legacy_state_dir(cfg))
    assert_same(wd.workflow_state, Path(workdir) / "workflow" / NAME)
    assert_same(wd.tracking_uri, legacy_default_tracking_uri(workdir))
    assert wd.tracking_uri == wd.default_tracking_uri == f"sqlite:///{tmp_path.resolve()}/work/mlflow.db"
    assert wd.tracking_db == tmp_path.resolve() / "work" / "mlflow.db"
    assert_same(wd.spark_ml, legacy_spark_ml(cfg))
    assert_same(wd.spark_ml_input, legacy_spark_ml(cfg) / "input")
    assert not (tmp_path / "work").exists()  # computing paths creates nothing


def test_relative_paths_stay_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wd = Workdir.of(config("work"))
    assert str(wd.shards) == f"work/shards/{NAME}"
    assert str(wd.models) == f"work/models/{NAME}"
    assert str(wd.workflow_state) == f"work/workflow/{NAME}"
    assert str(wd.raw_digits) == "work/raw/digits"
    assert str(wd.root) == f"{tmp_path}/work"


def test_configured_locations_win(workdir, tmp_path):
    cfg = config(workdir, train={"checkpoint_dir": "s3://bucket/ckpt"}, workflow={"state_dir": "state/here"},
                 tracking={"uri": " http://mlflow:5000 "},
                 data={"source": "synthetic", "path": "/data/raw", "shards_dir": "/data/shards"})
    wd = Workdir.of(cfg)
    assert wd.checkpoints == "s3://bucket/ckpt" == legacy_checkpoint_dir(cfg)
    assert_same(wd.workflow_state, Path("state/here"))
    assert_same(wd.workflow_state, legacy_state_dir(cfg))
    assert wd.tracking_uri == "http://mlflow:5000"
    # the SQLite file is the default's, whatever tracking.uri says; it is only used when nothing is set
    assert wd.default_tracking_uri == legacy_default_tracking_uri(workdir)
    assert_same(wd.raw_digits, Path("/data/raw"))
    assert_same(wd.raw_synthetic, Path("/data/raw"))
    assert_same(wd.shards, Path("/data/shards"))
    assert_same(wd.shard_partition("day", "1"), Path("/data/shards/day=1"))
    # the rest do not move
    assert_same(wd.models, legacy_model_dir(cfg))
    assert_same(wd.spark_ml, legacy_spark_ml(cfg))
    assert wd.root == tmp_path / "work"


def test_absolute_checkpoint_and_state_dirs(workdir, tmp_path):
    cfg = config(workdir, train={"checkpoint_dir": str(tmp_path / "ck")},
                 workflow={"state_dir": str(tmp_path / "st")})
    wd = Workdir.of(cfg)
    assert wd.checkpoints == str(tmp_path / "ck")
    assert_same(wd.workflow_state, tmp_path / "st")


def test_tracking_uri_env_beats_default_but_not_config(workdir, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", " http://env:5000 ")
    assert Workdir.of(config(workdir)).tracking_uri == "http://env:5000"
    assert Workdir.of(config(workdir, tracking={"uri": "http://cfg"})).tracking_uri == "http://cfg"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "  ")  # blank counts as unset
    assert Workdir.of(config(workdir)).tracking_uri == legacy_default_tracking_uri(workdir)


def test_home_relative_workdir(monkeypatch, tmp_path):
    # Only the SQLite store expands `~` (as before); the others keep it literally, as they always did.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    wd = Workdir.of(config("~/w"))
    assert wd.tracking_db == tmp_path.resolve() / "w" / "mlflow.db"
    assert str(wd.shards) == f"~/w/shards/{NAME}"
    assert wd.checkpoints == f"{tmp_path}/~/w/checkpoints/{NAME}"


def test_synthetic_folder_names_the_spec(tmp_path):
    regression = config(str(tmp_path), data={"source": "synthetic", "task": "regression",
                                             "synthetic": {"rows": 10, "features": 3, "seed": 7}})
    assert Workdir.of(regression).raw_synthetic == tmp_path / "raw" / "synthetic-10x3-regression-s7"
    classes = config(str(tmp_path), data={"source": "synthetic", "synthetic": {"rows": 10, "features": 3,
                                                                               "classes": 5}})
    assert Workdir.of(classes).raw_synthetic == tmp_path / "raw" / "synthetic-10x3-c5-s0"


def test_workdir_is_frozen(tmp_path):
    wd = Workdir.of(config(str(tmp_path)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        wd.path = "elsewhere"


def test_hidden_siblings_keep_their_names(tmp_path):
    from pipeline.config.workdir import hidden_sibling

    target = tmp_path / "shards" / NAME
    staging = hidden_sibling(target)
    assert staging.parent == target.parent
    assert re.fullmatch(rf"\.{re.escape(NAME)}\.staging-[0-9a-f]{{12}}", staging.name)
    assert re.fullmatch(r"\.digits\.tmp-[0-9a-f]{8}", hidden_sibling(tmp_path / "digits", "tmp", 8).name)
    assert hidden_sibling(target) != staging


# --- the modules' own functions now answer from Workdir -----------------------------------------

def test_module_functions_delegate(workdir, tmp_path):
    from pipeline.etl import shards_dir
    from pipeline.etl.sources import digits_raw_path
    from pipeline.etl.synthetic import synthetic_raw_path
    from pipeline.shards.write import staging_dir
    from pipeline.steps import model_dir, tracking_uri
    from pipeline.tracking import resolve_tracking_uri, tracking_uri_of
    from pipeline.workflow import state_dir

    cfg = config(workdir)
    wd = Workdir.of(cfg)
    assert_same(shards_dir(cfg), wd.shards)
    assert_same(model_dir(cfg), wd.models)
    assert_same(state_dir(cfg), wd.workflow_state)
    assert_same(digits_raw_path(cfg.data, cfg.workdir), wd.raw_digits)
    assert_same(synthetic_raw_path(cfg.data, cfg.workdir), wd.raw_synthetic)
    assert staging_dir(wd.shards).name.startswith(f".{NAME}.staging-")
    assert not (tmp_path / "work").exists()
    assert tracking_uri(cfg) == tracking_uri_of(cfg) == resolve_tracking_uri(None, workdir) == wd.tracking_uri
    assert wd.tracking_db.parent.is_dir()  # resolving the default creates the store's folder, as before
