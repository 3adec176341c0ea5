"""Artifacts cannot pick code: a factory named by a read-back artifact must be one the running config
allows, and the state must match the digest written with it — at every entry point that reads one
(evaluate's saved model, --resume's checkpoint, the Spark ML reader; `shardline score` in test_score.py)."""
import json

import numpy as np
import pytest
import torch

from pipeline.config import build
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.models.trust import ArtifactTrustError, allowed_factories, check_factory, open_model, seal_model

SPEC = ModelSpec(kind="mlp", num_features=4, num_outputs=3, task="classification", hidden=(5,)).to_dict()
EVIL = {**SPEC, "kind": "factory", "factory": "os:system", "factory_kwargs": {"command": "touch /tmp/pwned"}}


def _sealed():
    torch.manual_seed(0)
    return seal_model(SPEC, flat_parameters(build_model(ModelSpec.from_dict(SPEC))))


def test_built_ins_pass_and_a_factory_passes_only_when_the_config_names_it():
    cfg = build({"model": {"allowed_factories": ["user_models:wide"]}})
    check_factory(SPEC, allowed_factories(cfg.model), "x")
    check_factory({**EVIL, "factory": "user_models:wide"}, allowed_factories(cfg.model), "x")
    with pytest.raises(ArtifactTrustError, match=r"x names model.factory 'os:system', which the running config does "
                                                 r"not allow .*user_models:wide.*refusing to import it"):
        check_factory(EVIL, allowed_factories(cfg.model), "x")
    with pytest.raises(ArtifactTrustError, match="not a built-in"):
        check_factory({**SPEC, "kind": "os"}, (), "x")
    own = build({"model": {"factory": "user_models:wide"}})
    assert allowed_factories(own.model) == {"user_models:wide"}


def test_allowed_factories_is_validated_naming_the_key():
    from pipeline.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="allowed_factories"):
        build({"model": {"allowed_factories": ["not a path"]}})


def test_a_sealed_model_opens_and_a_flipped_or_unsealed_one_is_refused():
    state = _sealed()
    open_model(state, (), "m")
    flipped = {**state, "parameters": state["parameters"].clone()}
    flipped["parameters"][2] += 1e-3
    with pytest.raises(ArtifactTrustError, match=r"m: the model state does not match its sha256 digest"):
        open_model(flipped, (), "m")
    with pytest.raises(ArtifactTrustError, match="carries no state digest"):
        open_model({"spec": SPEC, "parameters": state["parameters"]}, (), "m")
    with pytest.raises(ArtifactTrustError, match="os:system"):  # refused before the digest is even looked at
        open_model({**state, "spec": EVIL}, (), "m")


def test_evaluate_refuses_a_tampered_saved_model(tmp_path):
    from pipeline import steps

    cfg = build({"name": "trust", "workdir": str(tmp_path)})
    folder = steps.model_dir(cfg)
    folder.mkdir(parents=True)
    state = _sealed()
    torch.save(state, folder / "model.pt")
    assert steps.load_saved_model(cfg)[0].to_dict() == SPEC
    torch.save({**state, "spec": EVIL}, folder / "model.pt")
    with pytest.raises(ArtifactTrustError, match="os:system"):
        steps.load_saved_model(cfg)
    state["parameters"][0] = 42.0
    torch.save(state, folder / "model.pt")
    with pytest.raises(ArtifactTrustError, match="does not match its sha256 digest"):
        steps.load_saved_model(cfg)


def test_resume_refuses_a_checkpoint_naming_a_factory_the_config_does_not(tmp_path):
    from pipeline.checkpoints import CheckpointStore
    from pipeline.launch.train import _resume_state

    cfg = build({"name": "trust", "workdir": str(tmp_path)})
    store = CheckpointStore(str(tmp_path / "ckpt"))
    # A checkpoint written (digest and all) by whoever can write the checkpoint directory.
    store.save({"step": 4, "model": EVIL, "ps": {"params": torch.zeros(3)}, "fingerprint": "f", "world_size": 2,
                "mode": "sync", "steps_per_epoch": 2})
    with pytest.raises(ArtifactTrustError, match=r"--resume: checkpoint .*ckpt-000000000004.pt names model.factory "
                                                 r"'os:system'.*refusing to import it"):
        _resume_state(cfg, store, None, ModelSpec.from_dict(SPEC))


def _spark_ml_model(spark, tmp_path):
    from pipeline.spark_ml import ShardlineModel

    state = _sealed()
    model = ShardlineModel()
    model._set_state(spec=SPEC, parameters=state["parameters"].numpy(), means=[0.0] * 4, stds=[1.0] * 4,
                     task="classification", labels=["a", "b", "c"], metrics={}, history=[])
    path = str(tmp_path / "ml")
    model.write().save(path)
    return path


def test_the_spark_ml_reader_refuses_a_tampered_factory_or_spec(spark, tmp_path):
    from pipeline.spark_ml import ShardlineModel

    path = _spark_ml_model(spark, tmp_path)
    assert np.array_equal(ShardlineModel.load(path).parameters, _sealed()["parameters"].numpy())
    state_file = tmp_path / "ml" / "shardline" / "state.json"
    info = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**info, "spec": EVIL}))
    with pytest.raises(ArtifactTrustError, match=r"saved ShardlineModel .* names model.factory 'os:system'"):
        ShardlineModel.load(path)
    state_file.write_text(json.dumps({**info, "spec": {**SPEC, "hidden": [6]}}))
    with pytest.raises(ArtifactTrustError, match="does not match its sha256 digest"):
        ShardlineModel.load(path)
    # An allowed factory passes the reader's check (the digest then still has to match).
    state_file.write_text(json.dumps({**info, "spec": {**EVIL, "factory": "user_models:wide"}}))
    with pytest.raises(ArtifactTrustError, match="does not match"):
        ShardlineModel.read().allowFactories("user_models:wide").load(path)
