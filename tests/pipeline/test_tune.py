"""`shardline tune`: Optuna trials that are real shardline training runs on digits, nested in MLflow,
pruned live, resumed after an interruption, the best config written and registered."""
from __future__ import annotations

import json

import pytest
import yaml

from pipeline.config import load
from pipeline.errors import ConfigError

SPACE = "tune.space={train.lr: {low: 0.0005, high: 0.3, log: true}, model.hidden: {choices: [[16], [64]]}}"


def test_space_keys_and_values_are_checked_before_any_trial(conf_dir, tmp_path):
    from pipeline.tune import _check_space, trial_config

    with pytest.raises(ConfigError, match=r"tune.space key 'data.path': only model\.\*"):
        load(f"{conf_dir}/digits.yaml", ["tune.space={data.path: {choices: [a, b]}}"])
    with pytest.raises(ConfigError, match="log: true needs low > 0"):
        load(f"{conf_dir}/digits.yaml", ["tune.space={train.lr: {low: 0, high: 1, log: true}}"])
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", "tune.space={train.lr: {choices: [0.1, -1]}}"])
    with pytest.raises(ConfigError, match=r"tune.space 'train.lr': the value -1 gives an invalid config"):
        _check_space(cfg)
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", "tune.space={train.no_such_key: {choices: [1]}}"])
    with pytest.raises(ConfigError, match="no_such_key"):
        _check_space(cfg)
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", SPACE])
    trial = trial_config(cfg, {"train.lr": 0.01, "model.hidden": [64]})
    assert trial.train.lr == 0.01 and list(trial.model.hidden) == [64] and trial.data == cfg.data
    assert cfg.tune.maximize and not load(f"{conf_dir}/digits.yaml", ["tune.metric=val_loss"]).tune.maximize


@pytest.mark.slow
def test_a_four_trial_search_finds_a_better_trial_resumes_and_registers_the_best(spark, conf_dir, tmp_path):
    import mlflow
    import optuna
    from mlflow import MlflowClient

    from pipeline.tune import tune

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load(f"{conf_dir}/digits.yaml", [f"workdir={tmp_path}", f"tracking.uri={uri}", "train.epochs=3",
                                           "tune.trials=4", "tune.seed=3", "tune.startup_trials=2", SPACE])
    first = tune(spark, cfg, trials=4)
    assert first.trials == 4
    study = optuna.load_study(study_name=first.study, storage=first.storage)
    values = [t.value for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(values) + first.pruned == 4 and len(values) >= 2
    assert first.best_value == max(values) > min(values)  # the search found a better trial than its worst
    for trial in study.trials:  # each trial reported its epochs to Optuna
        assert trial.intermediate_values and max(trial.intermediate_values) <= cfg.train.epochs - 1

    client = MlflowClient(uri)
    parent = client.get_run(first.parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{first.parent_run_id}'")
    assert len(children) == 4 and {r.data.tags["shardline.tune.trial"] for r in children} == {"0", "1", "2", "3"}
    pruned_runs = [r for r in children if r.data.tags.get("shardline.stopped") == "pruned"]
    assert len(pruned_runs) == first.pruned
    for run in children:
        assert "train.lr" in run.data.params and "val_accuracy" in run.data.metrics
    best_run = client.get_run(first.best_run_id)
    assert float(best_run.data.params["train.lr"]) == pytest.approx(first.best_params["train.lr"])

    best = yaml.safe_load(open(first.best_config))
    assert best["train"]["lr"] == pytest.approx(first.best_params["train.lr"])
    assert best["model"]["hidden"] == first.best_params["model.hidden"]
    assert load(first.best_config).train.lr == pytest.approx(first.best_params["train.lr"])  # a usable config
    assert "tune/best.yaml" in {a.path for a in client.list_artifacts(first.parent_run_id, "tune")}
    version = client.get_model_version("digits-tuned", first.model_version)  # <name>-tuned
    assert version.run_id == first.best_run_id and version.tags["shardline.tune.study"] == first.study

    # Interrupted after 4 of 5: the same command runs only the missing trial, in the same parent run.
    again = tune(spark, cfg, trials=5)
    assert again.trials == 5 and again.parent_run_id == first.parent_run_id
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{first.parent_run_id}'")
    assert len(children) == 5
    assert json.loads(json.dumps(again.best_params))  # plain values: lists decoded, not JSON text
    assert mlflow.active_run() is None
