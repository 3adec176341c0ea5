"""The training essentials end to end on digits, real local Spark, the driver's PS (and allreduce),
real MLflow: schedules as torch computes them, early stopping, the divergence guard on an injected
exploding step, bf16 autocast against fp32, fp16 refused on CPU."""
import pytest
import torch

from pipeline import steps
from pipeline.config import build, with_changes
from pipeline.errors import WorkerTrainingFailedError
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    work = tmp_path_factory.mktemp("options")
    cfg = build({"name": "options", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"hidden": [64]}, "train": {"epochs": 6, "batch_size": 32, "lr": 0.05, "checkpoint_every": 0},
                 "ps": {"timeout_s": 20}, "tracking": {"uri": f"sqlite:///{work}/mlflow.db", "log_model": False,
                                                       "system_metrics_interval_s": None}})
    manifest = run_etl(spark, cfg)
    return cfg, manifest, steps_per_epoch(manifest, 2, cfg.train.batch_size)


@pytest.fixture(scope="module")
def fp32_accuracy(spark, digits):
    cfg, manifest, _ = digits
    result = train(spark, cfg, manifest)
    return evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]


def _accuracy(spark, manifest, result) -> float:
    return evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]


@pytest.mark.parametrize("backend", ["ps", "allreduce"])
def test_the_rate_logged_per_epoch_is_torchs_sequential_lr_on_the_same_step(spark, digits, backend):
    from torch.optim import lr_scheduler as S

    cfg, manifest, spe = digits
    epochs, warmup = 3, 10
    cfg = with_changes(cfg, train={"epochs": epochs, "backend": backend, "clip_grad_norm": 1.0,
                                   "schedule": {"warmup_steps": warmup, "decay": "cosine", "min_lr_factor": 0.1}})
    result = train(spark, cfg, manifest)
    assert result.steps == spe * epochs

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.lr)
    total = spe * epochs
    sched = S.SequentialLR(opt, [S.LinearLR(opt, 0.01, 1.0, total_iters=warmup),
                                 S.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=0.1 * cfg.train.lr)],
                           milestones=[warmup])
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # each epoch's row: the rate of its last update
    assert [row["lr"] for row in result.history] == pytest.approx([rates[(e + 1) * spe - 1] for e in range(epochs)])
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


def test_early_stopping_stops_and_keeps_the_best_epoch_as_model_and_newest_checkpoint(spark, digits):
    from pipeline.checkpoints import CheckpointStore
    from pipeline.config.workdir import Workdir

    cfg, manifest, spe = digits
    # min_delta far over any change: only the first epoch is ever "better", so patience 1 stops after epoch 2
    # Rank 0 dawdles through epoch 2 (40 ms a step) so that the driver's checkpointer, which polls every 0.1 s,
    # writes checkpoints past the best epoch whatever the machine's speed (a fresh-clone CI ran all 19 steps
    # within one poll, and there was nothing to set aside).
    cfg = with_changes(cfg, train={"early_stopping": {"enabled": True, "metric": "val_loss", "patience": 1,
                                                      "min_delta": 100.0}, "checkpoint_every": 5},
                       faults={"delay_rank": 0, "delay_ms": 40, "delay_step": spe})
    result = train(spark, cfg, manifest)
    assert result.stopped["kind"] == "early_stop" and result.stopped["best_epoch"] == 0
    assert result.stopped["best_step"] == spe and result.steps == spe
    assert [row["epoch"] for row in result.history] == [0, 1]  # epochs 3.. never ran
    store = CheckpointStore(Workdir.of(cfg).checkpoints, cfg.train.keep_checkpoints)
    newest = store.load(store.latest())
    assert newest["step"] == spe and torch.equal(newest["ps"]["params"], result.parameters)
    # periodic checkpoints past the best epoch are set aside, so a --resume continues from the best
    assert all(info.step <= spe for info in store.list())
    assert CheckpointStore(f"{store.directory}/after_best", 10).list(), "the later checkpoints were moved, not lost"


def test_an_exploding_step_triggers_the_guard_and_the_run_keeps_and_tags_the_best_epoch(spark, digits, fp32_accuracy):
    from mlflow import MlflowClient

    cfg, manifest, spe = digits
    cfg = with_changes(cfg, train={"divergence": {"enabled": True, "factor": 10}},
                       faults={"explode_rank": 0, "explode_step": 3 * spe + 2, "explode_factor": 1e6})
    outcome = steps.train(spark, cfg)
    tags = MlflowClient(outcome.tracking_uri).get_run(outcome.run_id).data.tags
    assert tags["shardline.diverged"] == "true" and tags["shardline.stopped"] == "diverged"
    best_epoch = int(tags["shardline.best_epoch"])  # 1-based; the explosion was in epoch 4
    assert 1 <= best_epoch <= 3 and "train.divergence.factor=10" in tags["shardline.stop_reason"]
    spec, parameters, run_id = steps.load_saved_model(cfg)
    assert run_id == outcome.run_id
    accuracy = evaluate(spark, manifest, spec, parameters, "test").metrics["accuracy"]
    assert accuracy >= fp32_accuracy - 0.05, (accuracy, fp32_accuracy)


def test_a_nan_loss_with_the_guard_on_keeps_the_best_epoch_instead_of_failing(spark, digits):
    cfg, manifest, spe = digits
    # x 1e30: the parameters leave float range, the next loss is NaN/Inf and its rank raises NonFiniteError
    cfg = with_changes(cfg, train={"divergence": {"enabled": True}},
                       faults={"explode_rank": 1, "explode_step": 2 * spe + 1, "explode_factor": 1e30})
    result = train(spark, cfg, manifest)
    assert result.stopped["kind"] == "diverged" and result.stopped["best_epoch"] in (0, 1)
    assert "NonFiniteError" in result.stopped["reason"] or "not finite" in result.stopped["reason"]
    assert torch.isfinite(result.parameters).all()
    assert _accuracy(spark, manifest, result) > 0.8


def test_without_the_guard_the_nan_fails_the_run_as_before(spark, digits):
    cfg, manifest, spe = digits
    cfg = with_changes(cfg, faults={"explode_rank": 1, "explode_step": spe + 1, "explode_factor": 1e30},
                       train={"divergence": {"enabled": False}})
    with pytest.raises(WorkerTrainingFailedError, match="NonFiniteError"):
        train(spark, cfg, manifest)


def test_bf16_autocast_trains_digits_within_one_point_of_fp32(spark, digits, fp32_accuracy):
    cfg, manifest, _ = digits
    accuracy = _accuracy(spark, manifest, train(spark, with_changes(cfg, train={"precision": "bf16"}), manifest))
    assert abs(accuracy - fp32_accuracy) <= 0.01, (accuracy, fp32_accuracy)


def test_fp16_on_cpu_workers_fails_at_once_naming_the_key(spark, digits):
    cfg, manifest, _ = digits
    with pytest.raises(WorkerTrainingFailedError, match="train.precision=fp16 needs a CUDA device") as failed:
        train(spark, with_changes(cfg, train={"precision": "fp16", "max_attempts": 3}), manifest)
    assert failed.value.attempt == 1  # a config error: not retried
