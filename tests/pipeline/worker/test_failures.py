"""Failures a retry cannot cure come out of the worker typed (NonFiniteError, ModelInputError), flat and
staged, with ps and allreduce; a broken process group or link keeps its own (retryable) type."""
import socket
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import ModelInputError, NonFiniteError, PSError, PSTimeoutError, is_retryable
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.parallel.link import StageListener
from pipeline.parallel.stages import stage_slices
from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
from pipeline.ps.server.staged import StagedParameterServer
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import WorkerPlan, run
from pipeline.worker.distributed import Rendezvous
from pipeline.worker.store import StoreServer
from pipeline.worker.guards import keeps_its_type
from pipeline.worker.plan import Deadlines, LoaderPlan, StagePlan
from pipeline.worker.stage_loop import StageLinkError, StageWiring, model_stages

OPTIMIZER = OptimizerSpec(lr=0.1)


@pytest.fixture(autouse=True)
def _user_models(monkeypatch, request):
    # model.factory "user_models:..." imports tests/pipeline/models/user_models.py as a top-level module.
    monkeypatch.syspath_prepend(str(request.path.parents[1] / "models"))


def _shard(path, rows=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": y}), path, row_group_size=16)
    return str(path)


def _spec(factory):
    return ModelSpec(kind="factory", num_features=4, num_outputs=2, task="classification",
                     factory=f"user_models:{factory}")


def _plan(tmp_path, spec, rank, world, *, backend="ps", stage=None):
    return WorkerPlan(rank=rank, world_size=world, generation=1,
                      train_files=(_shard(tmp_path / f"s{rank}.parquet", seed=rank),), validation_files=(),
                      model=spec, features_field="features", label_field="label", epochs=2, steps_per_epoch=4,
                      seed=0, loader=LoaderPlan(prefetch=2), optimizer=OPTIMIZER, backend=backend, stage=stage,
                      deadlines=Deadlines.all(10))


def _settings():
    return PSSettings(optimizer=OPTIMIZER, step_timeout=Timeout.of(10, STEP_KEY))


def _in_threads(calls):
    """Run {rank: callable} in threads; (results, errors) by rank."""
    results, errors = {}, {}

    def target(rank, call):
        try:
            results[rank] = call()
        except Exception as exc:  # collected for the assertions
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def _train_flat(tmp_path, factory, world=2):
    spec = _spec(factory)
    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), _settings(), world_size=world, secret=secret,
                         host="127.0.0.1") as server:
        plans = [_plan(tmp_path, spec, r, world) for r in range(world)]
        _, errors = _in_threads({p.rank: (lambda p=p: run(p, *server.address, secret)) for p in plans})
        return errors, server.version


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_allreduce(tmp_path, factory):
    """One rank of train.backend=allreduce (a one-rank gloo group: DDP wraps the model as with many)."""
    spec = _spec(factory)
    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), _settings(), world_size=1, secret=secret,
                         host="127.0.0.1") as server:
        plan = _plan(tmp_path, spec, 0, 1, backend="allreduce")
        store = StoreServer("127.0.0.1", secret, plan.generation)
        try:
            with pytest.raises(Exception) as caught:
                run(plan, *server.address, secret,
                    rendezvous=Rendezvous(*store.address, plan.deadlines.connect, secret=secret,
                                          generation=plan.generation))
        finally:
            store.close()
        return caught.value


def _train_staged(tmp_path, factory, stages=2):
    spec = _spec(factory)
    torch.manual_seed(0)
    initial = flat_parameters(build_model(spec))
    ranges = stage_slices(model_stages(build_model(spec), stages))
    secret = new_secret()
    plans = [_plan(tmp_path, spec, s, stages, stage=StagePlan(stage=s, stages=stages, replica=0, replicas=1,
                                                              micro_batches=2)) for s in range(stages)]
    listeners = {s: StageListener("127.0.0.1", secret, 1, stage=s, rank=s, expect_rank=s - 1, timeout_s=10)
                 for s in range(1, stages)}
    with StagedParameterServer(initial, ranges, _settings(), replicas=1, secret=secret, host="127.0.0.1") as server:
        def call(plan):
            s = plan.rank
            wiring = StageWiring(listeners.get(s), listeners[s + 1].address if s < stages - 1 else None)
            return lambda: run(plan, *server.addresses[s], secret, wiring=wiring)

        _, errors = _in_threads({p.rank: call(p) for p in plans})
        return errors, server.version


# -- NaN/Inf losses --------------------------------------------------------------------------------
def test_a_nan_loss_raises_non_finite_error_naming_rank_step_epoch_and_the_fix(tmp_path):
    errors, version = _train_flat(tmp_path, "nan_mlp")
    # Both ranks' losses are NaN; whichever reports first fails as NonFiniteError, and the other either
    # does the same or is stopped by the server naming the first one's failure.
    first = [rank for rank, error in errors.items() if isinstance(error, NonFiniteError)]
    assert first, errors
    text = str(errors[first[0]])
    assert f"rank {first[0]}" in text and "step 0" in text and "epoch 0" in text
    assert "train.lr" in text and "data" in text
    assert not is_retryable(errors[first[0]])
    for rank in set(errors) - set(first):
        assert isinstance(errors[rank], PSError) and "NonFiniteError" in str(errors[rank])
    assert sorted(errors) == [0, 1]
    assert version == 0  # no NaN gradient was applied


def test_a_nan_loss_raises_non_finite_error_with_allreduce(tmp_path):
    error = _train_allreduce(tmp_path, "nan_mlp")
    assert isinstance(error, NonFiniteError), error
    assert "rank 0" in str(error) and "step 0" in str(error)


def test_a_nan_loss_on_the_last_pipeline_stage_raises_non_finite_error(tmp_path):
    errors, _ = _train_staged(tmp_path, "nan_stages")
    assert isinstance(errors[1], NonFiniteError), errors
    assert "stage 1 of 2" in str(errors[1]) and "step 0" in str(errors[1])
    assert isinstance(errors[0], (StageLinkError, PSError))  # the neighbour stopped as a consequence


# -- the model raising on its batch ----------------------------------------------------------------
def test_a_model_raising_on_its_batch_raises_model_input_error(tmp_path):
    errors, version = _train_flat(tmp_path, "rejecting_mlp")
    # Both ranks' models raise at step 0; whichever is first, the other may only see the step fail (PSError).
    raised = {rank: e for rank, e in errors.items() if isinstance(e, ModelInputError)}
    assert raised and all(isinstance(e, (ModelInputError, PSError)) for e in errors.values()), errors
    rank, error = min(raised.items())
    text = str(error)
    assert f"rank {rank}" in text and "step 0" in text
    assert "features {numeric: (16, 4) float32}" in text and "labels (16,) int64" in text
    assert "numeric[4]" in text and "batch dict" in text
    assert "model.factory='user_models:rejecting_mlp'" in text
    assert "expected 7 input features, got 2" in text and "fix the model" in text
    assert isinstance(error.__cause__, ValueError)
    assert not is_retryable(error)
    assert version == 0


def test_a_model_raising_on_its_batch_raises_model_input_error_with_allreduce(tmp_path):
    error = _train_allreduce(tmp_path, "rejecting_mlp")
    assert isinstance(error, ModelInputError), error
    assert isinstance(error.__cause__, ValueError)


def test_a_pipeline_stage_raising_on_its_activations_raises_model_input_error(tmp_path):
    errors, _ = _train_staged(tmp_path, "rejecting_stages")
    error = errors[1]
    assert isinstance(error, ModelInputError), errors
    assert "stage 1 of 2" in str(error) and "activations from stage 0" in str(error)
    assert "labels (16,) int64" in str(error)
    assert isinstance(errors[0], (StageLinkError, PSError))  # stage 0 was stopped, not blamed


@pytest.mark.parametrize("exc", [PSError("rank 1 failed"), PSTimeoutError("timed out"), OSError("reset"),
                                 ConnectionResetError("peer"), torch.distributed.DistBackendError("nccl"),
                                 RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                                              "closed by peer [127.0.0.1]:1234"), MemoryError()])
def test_errors_of_a_broken_group_or_link_keep_their_type(exc):
    assert keeps_its_type(exc)


@pytest.mark.parametrize("exc", [RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 7x2)"),
                                 ValueError("bad"), TypeError("forward() takes 1 positional argument"),
                                 IndexError("Target 5 is out of bounds.")])
def test_errors_of_the_model_on_its_batch_are_made_model_input_errors(exc):
    assert not keeps_its_type(exc)


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: unspecified launch failure"),
                                 RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
                                 RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm")])
def test_errors_of_a_failing_device_keep_their_type_and_are_retried(exc):
    assert keeps_its_type(exc) and is_retryable(exc)


def test_the_server_hears_a_workers_own_non_finite_loss_as_the_cause(tmp_path):
    """A NaN loss is found on the worker before anything is pushed; its FAIL must still reach the PS, so
    the driver's root cause names NonFiniteError rather than "closed its connection"."""
    spec = _spec("nan_mlp")
    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), _settings(), world_size=1, secret=secret,
                         host="127.0.0.1") as server:
        with pytest.raises(NonFiniteError):
            run(_plan(tmp_path, spec, 0, 1), *server.address, secret)
        assert "NonFiniteError" in server.root_failures[0].error, server.root_failures
