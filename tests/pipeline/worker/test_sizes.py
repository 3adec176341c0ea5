"""The sizes a worker holds every WELCOME against (``pipeline.worker.sizes``): the same counts as the model
it trains, for every built-in kind, a pipeline stage, a user factory, and None when the model cannot build."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch.nn as nn

from pipeline.config.schema import ModelConfig
from pipeline.config.feature_spec import FeatureSet, FeatureSpec
from pipeline.models import ModelSpec, build_model, model_spec, num_parameters
from pipeline.models.state import buffer_layout, layout_slots
from pipeline.parallel.stages import model_stages
from pipeline.worker import WorkerPlan
from pipeline.worker.plan import StagePlan
from pipeline.worker.sizes import expected_sizes

MLP = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))
DIGIT = FeatureSpec(name="digit", type="image", height=8, width=8, channels=1)


def plan(spec: ModelSpec, stage=None) -> WorkerPlan:
    return WorkerPlan(rank=0, world_size=1, generation=1, train_files=(), validation_files=(), model=spec,
                      features_field="features", label_field="label", epochs=1, steps_per_epoch=1, seed=0,
                      stage=stage)


def counts(module: nn.Module) -> tuple[int, int]:
    return num_parameters(module), layout_slots(buffer_layout(module))


@pytest.mark.parametrize("spec", [
    MLP,
    replace(MLP, kind="logreg"),
    model_spec(ModelConfig(kind="cnn", hidden=[16]), features=FeatureSet((DIGIT,)), num_classes=10,
               task="classification"),
], ids=["mlp", "logreg", "cnn"])
def test_the_counts_are_the_built_models(spec) -> None:
    assert expected_sizes(plan(spec)) == counts(build_model(spec))


def test_a_pipeline_stage_counts_its_own_slice() -> None:
    stages = model_stages(build_model(MLP), 2)
    for index, module in enumerate(stages):
        grid = StagePlan(stage=index, stages=2, replica=0, replicas=1)
        assert expected_sizes(plan(MLP, grid)) == counts(module)
    assert counts(stages[0])[0] != counts(stages[1])[0]  # the two slices differ: the stage was honoured


def test_a_model_that_cannot_build_is_left_to_the_loop() -> None:
    broken = replace(MLP, kind="factory", factory="no_such_module_anywhere:factory")
    assert expected_sizes(plan(broken)) == (None, None)
