"""The allreduce backend's DDP wrapper (pipeline.worker.ddp) in a real one-rank gloo group: the options it
sets keep gradients as bucket views and step like plain SGD, a group of one trains unwrapped, and the flat
allreduce loop trains exactly like plain SGD on the same batches. Two ranks: tests/pipeline/launch/test_allreduce.py."""
import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.models import ModelSpec, build_model, flat_parameters, load_flat_parameters, loss_fn
from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import WorkerPlan, run
from pipeline.worker.distributed import Rendezvous, process_group
from pipeline.worker.plan import Deadlines, LoaderPlan
from pipeline.worker.skeleton import make_train_loader
from pipeline.worker.store import StoreServer

OPTIMIZER = OptimizerSpec(lr=0.1, momentum=0.9)
SPEC = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))


@contextlib.contextmanager
def _rendezvous(timeout, secret=None, generation=1):
    """A one-rank group's authenticated store (pipeline.worker.store), as rank 0's task serves it."""
    secret = secret or new_secret()
    store = StoreServer("127.0.0.1", secret, generation)
    try:
        yield Rendezvous(*store.address, timeout, secret=secret, generation=generation)
    finally:
        store.close()


def _plan(tmp_path, epochs=2, steps=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, 64 * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    path = tmp_path / "s0.parquet"
    pq.write_table(pa.table({"features": features, "label": y}), path, row_group_size=16)
    return WorkerPlan(rank=0, world_size=1, generation=1, train_files=(str(path),), validation_files=(),
                      model=SPEC, features_field="features", label_field="label", epochs=epochs,
                      steps_per_epoch=steps, seed=0, loader=LoaderPlan(prefetch=2), optimizer=OPTIMIZER,
                      backend="allreduce", deadlines=Deadlines.all(10))


def test_the_ddp_options_keep_gradients_as_views_of_the_buckets():
    """Views of the buckets, set to None before each backward as the loop does, and SGD on them steps
    exactly like plain torch (a group of one: the average is the rank's own gradient)."""
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.worker.ddp import DDP_OPTIONS

    torch.manual_seed(0)
    model, plain = build_model(SPEC), build_model(SPEC)
    plain.load_state_dict(model.state_dict())
    loss = loss_fn("classification")
    with _rendezvous(10) as rendezvous, process_group(rendezvous, 0, 1, "cpu"):
        ddp = DistributedDataParallel(model, **DDP_OPTIONS)  # what wrap() builds for a group of 2+ ranks
        assert ddp.gradient_as_bucket_view is True
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            for m, forward, opt in ((model, ddp, opts[0]), (plain, plain, opts[1])):
                for p in m.parameters():
                    p.grad = None
                loss(forward(x), y).backward()
                opt.step()
            views = [p.grad for p in model.parameters()]
            # views of one bucket: the gradients' storages are shared, no per-parameter copies
            assert len({g.untyped_storage().data_ptr() for g in views}) < len(views)
    assert not torch.distributed.is_initialized()
    assert torch.allclose(flat_parameters(model), flat_parameters(plain), atol=1e-6)


def test_a_group_of_one_rank_trains_the_model_unwrapped():
    from pipeline.worker.ddp import wrap

    with _rendezvous(10) as rendezvous, process_group(rendezvous, 0, 1, "cpu"):
        model = build_model(SPEC)
        assert wrap(model, "cpu") is model


def test_the_allreduce_loop_trains_exactly_like_plain_sgd_on_the_same_batches(tmp_path):
    plan = _plan(tmp_path)
    torch.manual_seed(0)
    initial = flat_parameters(build_model(SPEC))
    secret = new_secret()
    reports = []
    settings = PSSettings(optimizer=OPTIMIZER, step_timeout=Timeout.of(10, STEP_KEY))
    with ParameterServer(initial, settings, world_size=1, secret=secret, host="127.0.0.1",
                         on_metrics=lambda r, m: reports.append(m)) as server:
        with _rendezvous(plan.deadlines.connect, secret, plan.generation) as rendezvous:
            result = run(plan, *server.address, secret, rendezvous=rendezvous)
    assert result.steps == 8 and server.stats["pushes_applied"] == 0
    assert [m["epoch"] for m in reports] == [0, 1] and all(m["cpu_s"] > 0 for m in reports)
    trained = torch.from_numpy(np.frombuffer(result.parameters, dtype=np.float32).copy())

    model = build_model(SPEC)
    load_flat_parameters(model, initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = loss_fn("classification")
    loader = make_train_loader(plan)  # the same seeded batches the rank drew
    for epoch in range(2):
        for x, y in loader.epoch(epoch):
            opt.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
            opt.step()
    assert torch.allclose(trained, flat_parameters(model), atol=1e-6)
    assert not torch.equal(trained, initial)


def test_a_refused_setting_fails_before_the_rank_joins_its_group(tmp_path):
    """The exchange (precision, local optimizer) is built before the rendezvous: a rank that cannot train
    says why at once, instead of first waiting in a group its peers may never complete."""
    import dataclasses

    from pipeline.errors import ConfigError

    plan = dataclasses.replace(_plan(tmp_path), world_size=2, precision="fp16")  # fp16 needs CUDA
    secret = new_secret()
    settings = PSSettings(optimizer=OPTIMIZER, step_timeout=Timeout.of(10, STEP_KEY))
    with ParameterServer(flat_parameters(build_model(SPEC)), settings, world_size=2, secret=secret,
                         host="127.0.0.1") as server:
        with pytest.raises(ConfigError, match="train.precision=fp16"):
            # no peer ever joins this group: joining first would end in the rendezvous timeout instead
            with _rendezvous(30, secret, plan.generation) as rendezvous:
                run(plan, *server.address, secret, rendezvous=rendezvous)
    assert not torch.distributed.is_initialized()
