"""Buffers are model state, on a real local Spark session: a BatchNorm MLP (``model.factory``) through
every backend, mode and placement ends with trained running statistics in the merged model and in the
last checkpoint, and a --resume continues from the checkpoint's statistics."""
import pytest
import torch

from pipeline.checkpoints import CheckpointStore
from pipeline.config import Workdir, build, with_changes
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from pipeline.models.state import flat_buffers
from pipeline.shards import steps_per_epoch


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory, user_models):
    work = tmp_path_factory.mktemp("buffers")
    cfg = build({"name": "buffers", "workdir": str(work), "parallelism": {"data": 2}, "data": {"source": "digits"},
                 "model": {"factory": f"{user_models}:bn_mlp", "factory_kwargs": {"width": 32}},
                 "train": {"epochs": 2, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "checkpoint_every": 1000},
                 "ps": {"timeout_s": 20}})
    return cfg, run_etl(spark, cfg)


def norms(model):
    found = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert found
    return found


CASES = {
    "sync": {},
    "async": {"ps": {"mode": "async"}},
    "average": {"ps": {"mode": "average", "sync_every": 4}},
    "allreduce": {"train": {"backend": "allreduce"}},
    "task-placement": {"ps": {"placement": "task"}},
    # 2 stages x 1 replica: local[2] has two task slots
    "pipeline-stages": {"parallelism": {"data": 1, "pipeline": 2}, "model": {"factory": "user_models:bn_stages"}},
    "allreduce-task-placement": {"train": {"backend": "allreduce"}, "ps": {"placement": "task"}},
    "allreduce-pipeline-stages": {"train": {"backend": "allreduce"}, "parallelism": {"data": 1, "pipeline": 2},
                                  "model": {"factory": "user_models:bn_stages"}},
}


# sync runs in the default suite; the other backends, modes and placements with the slow ones.
@pytest.mark.parametrize("case", [c if c == "sync" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_the_merged_and_checkpointed_model_carries_trained_running_statistics(spark, digits, case):
    cfg, manifest = digits
    cfg = with_changes(cfg, name=f"buffers-{case}", **CASES[case])
    if cfg.parallelism.data != 2:
        manifest = run_etl(spark, cfg)  # one train shard per replica
    result = train(spark, cfg, manifest)
    steps = steps_per_epoch(manifest, cfg.parallelism.data, cfg.train.batch_size) * cfg.train.epochs
    model = result.model()
    for bn in norms(model):
        # every replica ran every step; an integer counter, never a float average
        assert bn.num_batches_tracked.item() == steps
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    # the same state reaches evaluation in Spark: eval-mode BatchNorm with these statistics classifies well
    accuracy = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    assert accuracy >= 0.85, accuracy
    if cfg.train.backend == "ps":
        latest = CheckpointStore(Workdir.of(cfg).checkpoints).latest()
        state = CheckpointStore(Workdir.of(cfg).checkpoints).load(latest)["ps"]
        saved = torch.cat([s["buffers"] for s in state["stages"]]) if "stages" in state else state["buffers"]
        assert latest.step == result.steps and torch.equal(saved, flat_buffers(model))


def test_resume_continues_from_the_checkpointed_running_statistics(spark, digits):
    cfg, manifest = digits
    first = with_changes(cfg, name="buffers-resume", train={"epochs": 1})
    done = train(spark, first, manifest)
    steps = done.steps
    assert norms(done.model())[0].num_batches_tracked.item() == steps
    # Another epoch from the checkpoint: the workers start from its statistics, so the counter goes on.
    resumed = train(spark, with_changes(first, train={"epochs": 2}), manifest, resume=True)
    assert resumed.resumed_from_step == steps and resumed.steps == 2 * steps
    assert norms(resumed.model())[0].num_batches_tracked.item() == 2 * steps


def _single_process_accuracy(spark, cfg, manifest, spec, *, batch_norm: bool = True) -> float:
    """One process, one model, trained on the ranks' batches of every step concatenated (the global batch,
    drawn by the workers' own loaders), then evaluated like the merged model."""
    from pipeline.launch.plans import worker_plans
    from pipeline.models import build_model, loss_fn
    from pipeline.models.state import flat_state
    from pipeline.worker.loop import make_train_loader

    steps = steps_per_epoch(manifest, cfg.parallelism.data, cfg.train.batch_size)
    loaders = [make_train_loader(plan) for plan in worker_plans(cfg, manifest, spec, steps, 1, 1)]
    torch.manual_seed(cfg.train.seed)
    model = build_model(spec)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum,
                                weight_decay=cfg.train.weight_decay)
    loss = loss_fn(manifest.task)
    for epoch in range(cfg.train.epochs):
        for batches in zip(*(loader.epoch(epoch) for loader in loaders)):
            xs = [x for x, _ in batches]
            x = ({k: torch.cat([b[k] for b in xs]) for k in xs[0]} if isinstance(xs[0], dict) else torch.cat(xs))
            y = torch.cat([y for _, y in batches])
            optimizer.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
            optimizer.step()
    return evaluate(spark, manifest, spec, flat_state(model), "test").metrics["accuracy"]


# (case, the largest test-accuracy gap to single-process training on the same batches this mode keeps).
# sync and allreduce: 1 pp, the acceptance. async and average keep, on the plain MLP without BatchNorm,
# a gap of up to 2 pp on this split (measured: see the report); BatchNorm must not widen it.
ACCURACY_CASES = [("sync", 0.01), ("allreduce", 0.01), ("async", 0.02), ("average", 0.02)]


@pytest.mark.slow
@pytest.mark.parametrize("case,margin", ACCURACY_CASES)
def test_batchnorm_test_accuracy_matches_single_process_training_on_the_same_batches(spark, digits, case, margin):
    cfg, manifest = digits
    cfg = with_changes(with_changes(cfg, name=f"buffers-acc-{case}", train={"epochs": 8}), **CASES[case])
    result = train(spark, cfg, manifest)
    distributed = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics["accuracy"]
    single = _single_process_accuracy(spark, cfg, manifest, result.spec)
    print(f"\nbatchnorm {case}: distributed test accuracy {distributed:.4f}, single process {single:.4f}")
    assert abs(distributed - single) <= margin + 1e-9, (distributed, single)
